"""Export of a committed step's model tensors as a Hugging Face-style safetensors folder.

The output files are shared out over the ranks: each rank assembles only the tensors of its own
files, reading them from the checkpoint (so no rank ever holds the whole model and no collective
runs), and rank 0 writes `model.safetensors.index.json` once every file is there.
"""
from __future__ import annotations

import json
import time
from typing import Callable

import safetensors.torch
import torch

from .commit import POLL_MAX_S
from .file_format import DTYPES
from .reader import StepReader, run_tasks
from .storage import Storage

INDEX = "model.safetensors.index.json"


# (name, state path, shape, output dtype, output bytes) of one exported tensor.
_Wanted = tuple[str, str, tuple[int, ...], torch.dtype, int]


def export_hf(
    reader: StepReader,
    out: Storage,
    *,
    prefix: str,
    rename: Callable[[str], str | None] | None,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    rank: int,
    world_size: int,
    timeout_s: float,
) -> list[str]:
    """Write this rank's files (and, on rank 0, the index); returns the names this rank wrote.

    Tensor names are the state paths under `prefix` with the prefix removed, then passed through
    `rename` (returning None drops a tensor). `dtype` casts floating-point tensors.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    wanted = _wanted_tensors(reader, prefix=prefix, rename=rename, dtype=dtype)
    shards = _pack_shards(wanted, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out.makedirs("")
    written = []
    for index in range(rank, len(shards), world_size):
        _write_shard_file(reader, out, [wanted[i] for i in shards[index]], files[index])
        written.append(files[index])
    if rank == 0:
        _wait_for_files(out, files, timeout_s)
        _write_index(out, wanted, shards, files)
        written.append(INDEX)
    return written


def _wanted_tensors(
    reader: StepReader,
    *,
    prefix: str,
    rename: Callable[[str], str | None] | None,
    dtype: torch.dtype | None,
) -> list[_Wanted]:
    """The tensors to export, in checkpoint order, with their export names and output dtypes."""
    wanted: list[_Wanted] = []
    for path, entry in reader.metadata["tensors"].items():
        if not path.startswith(prefix):
            continue
        name = rename(path[len(prefix):]) if rename is not None else path[len(prefix):]
        if name is None:
            continue
        saved = DTYPES[entry["dtype"]]
        out_dtype = dtype if dtype is not None and saved.is_floating_point else saved
        numel = 1
        for s in entry["shape"]:
            numel *= s
        wanted.append((name, path, tuple(entry["shape"]), out_dtype, numel * out_dtype.itemsize))
    if not wanted:
        raise ValueError(f"step {reader.step} has no tensors under prefix {prefix!r}")
    names = [w[0] for w in wanted]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"export names collide after renaming: {dup[:8]}")
    return wanted


def _pack_shards(wanted: list[_Wanted], max_shard_bytes: int) -> list[list[int]]:
    """Indices into `wanted`, grouped greedily in order into files of at most `max_shard_bytes`
    (a single larger tensor gets a file of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, w in enumerate(wanted):
        if shards[-1] and size + w[4] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += w[4]
    return shards


def _write_shard_file(reader: StepReader, out: Storage, tensors_of_file: list[_Wanted], filename: str) -> None:
    """Read the file's tensors whole from the checkpoint, cast them, and write one safetensors file."""
    tensors = {}
    for name, path, shape, out_dtype, _ in tensors_of_file:
        full = torch.empty(shape, dtype=DTYPES[reader.metadata["tensors"][path]["dtype"]])
        run_tasks(reader, reader.tensor_tasks(path, full))
        tensors[name] = full.to(out_dtype)
    out.write_file(filename, safetensors.torch.save(tensors, metadata={"format": "pt"}))


def _wait_for_files(out: Storage, files: list[str], timeout_s: float) -> None:
    """Poll until every rank's files exist, so the index never names a missing file."""
    deadline = time.monotonic() + timeout_s
    while not all(out.exists(f) for f in files):
        if time.monotonic() > deadline:
            missing = [f for f in files if not out.exists(f)]
            raise TimeoutError(f"export: {missing[:4]} not written by the other ranks within {timeout_s:.0f} s")
        time.sleep(POLL_MAX_S)


def _write_index(out: Storage, wanted: list[_Wanted], shards: list[list[int]], files: list[str]) -> None:
    """Write `model.safetensors.index.json`: the total size and which file holds each tensor."""
    index = {
        "metadata": {"total_size": sum(w[4] for w in wanted)},
        "weight_map": {wanted[i][0]: files[f] for f, shard in enumerate(shards) for i in shard},
    }
    out.write_file(INDEX, json.dumps(index, indent=2).encode())
