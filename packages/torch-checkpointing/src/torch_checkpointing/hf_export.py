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
from .reader import StepReader
from .storage import Storage

INDEX = "model.safetensors.index.json"


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
    wanted: list[tuple[str, str, tuple[int, ...], torch.dtype, int]] = []  # (name, path, shape, dtype, nbytes)
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
    shards: list[list[int]] = [[]]
    size = 0
    for i, w in enumerate(wanted):
        if shards[-1] and size + w[4] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += w[4]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out.makedirs("")
    written = []
    for index in range(rank, len(shards), world_size):
        tensors = {}
        for i in shards[index]:
            name, path, shape, out_dtype, _ = wanted[i]
            full = torch.empty(shape, dtype=DTYPES[reader.metadata["tensors"][path]["dtype"]])
            for future in [reader.io_pool.submit(task) for task in reader.tensor_tasks(path, full)]:
                future.result()
            tensors[name] = full.to(out_dtype)
        out.write_file(files[index], safetensors.torch.save(tensors, metadata={"format": "pt"}))
        written.append(files[index])
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while not all(out.exists(f) for f in files):
            if time.monotonic() > deadline:
                missing = [f for f in files if not out.exists(f)]
                raise TimeoutError(f"export: {missing[:4]} not written by the other ranks within {timeout_s:.0f} s")
            time.sleep(POLL_MAX_S)
        index = {
            "metadata": {"total_size": sum(w[4] for w in wanted)},
            "weight_map": {wanted[i][0]: files[f] for f, shard in enumerate(shards) for i in shard},
        }
        out.write_file(INDEX, json.dumps(index, indent=2).encode())
        written.append(INDEX)
    return written
