"""The on-disk format: safetensors data files and the JSON records that describe a step.

A step directory holds, per rank R, `rank-RRRRR.safetensors` (an ordinary safetensors file: 8-byte
little-endian header length, JSON header, raw row-major little-endian tensor bytes) and
`rank-RRRRR.<fingerprint>.json` (checksums, plain values, the rank's layout); plus `metadata.json` (the global
layout: every tensor's dtype, global shape and chunks) and `commit.json` (present once committed).
"""
from __future__ import annotations

import ctypes
import json
import struct
import zlib
from typing import Any

import torch

FORMAT = "torch-checkpointing"
VERSION = 1
DATA_ALIGNMENT = 4096  # the header is padded so tensor data starts page-aligned

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}

COMMIT = "commit.json"
METADATA = "metadata.json"


def step_dir(step: int) -> str:
    return f"step-{step}"


def temp_dir(step: int) -> str:
    return f".tmp-step-{step}"


def failed_step_file(step: int) -> str:
    """Rank 0's note that a step failed, beside the steps: the step's own folder is removed."""
    return f".failed-step-{step}"


def damaged_dir(step: int) -> str:
    """Where a load moves a committed step found damaged (not a step any more; never removed by us)."""
    return f"damaged-step-{step}"


def parse_step_dir(name: str) -> int | None:
    prefix = "step-"
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def data_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def record_file(rank: int, fingerprint: str) -> str:
    """A rank's record; its layout fingerprint is in the name so the committer sees changes by listing."""
    return f"rank-{rank:05d}.{fingerprint}.json"


def parse_record_file(name: str) -> tuple[int, str] | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[0].startswith("rank-") and parts[0][5:].isdigit() and parts[2] == "json":
        return int(parts[0][5:]), parts[1]
    return None


def failure_file(rank: int) -> str:
    return f"rank-{rank:05d}.failed"


def dtype_name(dtype: torch.dtype, path: str) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"state {path!r} has dtype {dtype}, which safetensors cannot store; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in DTYPE_NAMES)
        ) from None


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """(header bytes incl. the length prefix, data offset of each tensor) for (name, dtype, shape, nbytes)."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offsets, position = [], 0
    for name, dtype, shape, nbytes in tensors:
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + nbytes]}
        offsets.append(position)
        position += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    padded = -(-(8 + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - 8
    text += b" " * (padded - len(text))  # trailing spaces are allowed by the safetensors spec
    return struct.pack("<Q", len(text)) + text, offsets


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (and without numpy)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def block_checksums(data: memoryview, start: int, block_bytes: int) -> list[list[int]]:
    """[[offset, crc32], ...] for consecutive blocks of `data`, offsets counted from `start`."""
    out = []
    for lo in range(0, len(data), block_bytes):
        out.append([start + lo, zlib.crc32(data[lo:lo + block_bytes])])
    return out


def to_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
