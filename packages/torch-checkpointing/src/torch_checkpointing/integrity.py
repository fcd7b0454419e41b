"""Checksums of a step's JSON records, and the check that a committed step is intact before a load.

Every JSON file of a step (`commit.json`, `metadata.json`, the rank records) ends with its own
checksum, `..., "crc32": "<8 hex digits>"}`: the CRC32 of every byte before `,"crc32"`. The file stays
one JSON object that any reader parses; a flipped bit anywhere in it (the checksum included) no
longer matches. Each record holds the size of its rank's data file and the CRC32 of that file's
safetensors header; the tensor bytes after the header have their block checksums in the record,
verified as a load reads them.

`find_damage` checks a step's records and data files without reading tensor data: it reads every
JSON file and each data file's header, which every rank can do and gets the same answer from.
"""
from __future__ import annotations

import json
import re
import zlib
from typing import Any

from .file_format import COMMIT, METADATA, step_dir, to_json
from .storage import Storage

_SEAL = re.compile(rb',"crc32":"([0-9a-f]{8})"}')
_SEAL_BYTES = len(b',"crc32":"00000000"}')


class ChecksumError(RuntimeError):
    """A step's stored bytes do not match their checksums, or one of its files is missing or
    truncated: the message names the file (and for tensor data the tensor and byte range)."""


def sealed_json(obj: dict) -> bytes:
    """`obj` as compact JSON ending with the CRC32 of the bytes before it (see the module doc)."""
    assert isinstance(obj, dict) and obj and "crc32" not in obj
    body = to_json(obj)[:-1]  # without the closing brace
    return body + b',"crc32":"%08x"}' % zlib.crc32(body)


def open_sealed(data: bytes, where: str) -> dict:
    """The object of a sealed JSON file; ChecksumError naming `where` if any byte of it changed."""
    match = _SEAL.fullmatch(data[-_SEAL_BYTES:])
    if match is None:
        raise ChecksumError(f"{where} is damaged: it does not end with its checksum (truncated or overwritten?)")
    body = data[:-_SEAL_BYTES]
    if zlib.crc32(body) != int(match.group(1), 16):
        raise ChecksumError(f"{where} is damaged: its bytes do not match the checksum written at save time")
    try:
        obj = json.loads(data)
    except ValueError as e:  # checksum right but not JSON: not written by this library
        raise ChecksumError(f"{where} is not a valid record: {e}") from None
    del obj["crc32"]
    return obj


def read_sealed(storage: Storage, path: str) -> dict:
    """Read and check a sealed JSON file; a missing file is damage too (ChecksumError)."""
    try:
        data = storage.read_file(path)
    except FileNotFoundError:
        raise ChecksumError(f"{storage.describe(path)} is missing") from None
    return open_sealed(data, storage.describe(path))


def find_damage(storage: Storage, step: int, *, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why committed `step` cannot be loaded as saved (its first problem), or None when its records
    and data files are intact. Tensor bytes are not read here: their block checksums are checked
    by the load that reads them.

    share: (i, n) checks the commit record, the metadata and every n-th rank record from the i-th,
    so that n loading ranks that pool their findings read each record once.
    """
    directory = step_dir(step)
    try:
        commit = read_sealed(storage, f"{directory}/{COMMIT}")
        metadata = read_sealed(storage, f"{directory}/{METADATA}")
        where = storage.describe(f"{directory}/{METADATA}")
        if commit.get("step") != step or commit.get("world_size") != metadata.get("world_size"):
            return f"{storage.describe(f'{directory}/{COMMIT}')} describes another step or world size"
        if len(metadata.get("records", ())) != metadata["world_size"]:
            return f"{where} lists {len(metadata.get('records', ()))} rank records for {metadata['world_size']} ranks"
        index, count = share
        for rank in range(index, len(metadata["records"]), count):
            name = metadata["records"][rank]
            problem = _record_damage(storage, directory, step, rank, name)
            if problem is not None:
                return problem
    except ChecksumError as e:
        return str(e)
    except (KeyError, TypeError) as e:  # a record with a valid checksum but missing fields: another writer
        return f"step {step} in {storage.describe(directory)} lacks a field this version needs: {e}"
    return None


def _record_damage(storage: Storage, directory: str, step: int, rank: int, name: str) -> str | None:
    record = read_sealed(storage, f"{directory}/{name}")
    where = storage.describe(f"{directory}/{name}")
    if record["step"] != step or record["rank"] != rank:
        return f"{where} is the record of step {record['step']} rank {record['rank']}, not of step {step} rank {rank}"
    data = f"{directory}/{record['file']}"
    try:
        size = storage.size(data)
    except FileNotFoundError:
        return f"{storage.describe(data)} is missing"
    if size != record["file_bytes"]:
        return (f"{storage.describe(data)} is damaged: it holds {size} bytes, "
                f"but {record['file_bytes']} were written (truncated or overwritten?)")
    header = bytearray(record["header_bytes"])
    storage.read_into(data, 0, memoryview(header))
    if zlib.crc32(header) != record["header_crc32"]:
        return f"{storage.describe(data)} is damaged: its safetensors header does not match the checksum written at save time"
    return None


def record_fields(header: bytes, file_bytes: int) -> dict[str, Any]:
    """What a rank record says about its data file, so a damaged or cut file is found before a load."""
    return {"file_bytes": file_bytes, "header_bytes": len(header), "header_crc32": zlib.crc32(header)}
