"""The Checkpointer's settings."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(kw_only=True, frozen=True)
class CheckpointerConfig:
    """How a Checkpointer saves, keeps and loads steps.

    keep_last: keep only the newest N committed steps (None keeps all).
    keep_every: also keep every step divisible by K forever (with keep_last).
    per_rank: path prefixes ("rng", "data.loader") of plain tensors that differ between ranks, stored
        once per rank; other plain tensors are taken as replicated and stored once. Plain values
        (int, float, str, bytes, ...) are always stored per rank.
    io_threads: threads that write data in parallel.
    read_threads: threads that read data in parallel on load: each takes the next chunk of a data
        file, so the disk sees this many reads in flight (a cold NVMe read 2.5 GB/s with 8 threads
        against 1.3 GB/s with 1 on the H200 host: docs/benchmarks.md).
    read_chunk_bytes: one read of a load (cut at checksum blocks); a GPU load keeps one to two
        pinned host buffers of this size per read thread, so each thread reads its next chunk while
        its last one is copied to the device.
    block_bytes: checksum granularity; a resharding load reads whole blocks.
    slab_bytes: size of each reusable host staging buffer.
    commit_timeout_s: how long rank 0 waits for the other ranks before failing a step.
    verify: check every checksum on load.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    per_rank: tuple[str, ...] = ()
    io_threads: int = min(8, os.cpu_count() or 1)
    read_threads: int = min(8, os.cpu_count() or 1)
    read_chunk_bytes: int = 16 << 20
    block_bytes: int = 1 << 20
    slab_bytes: int = 256 << 20
    commit_timeout_s: float = 1800.0
    verify: bool = True

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError("keep_every applies on top of keep_last; set keep_last too (None keeps every step)")
        if isinstance(self.per_rank, str) or not all(isinstance(p, str) and p for p in self.per_rank):
            raise TypeError(f"per_rank must be a tuple of path prefixes such as ('rng',), got {self.per_rank!r}")
        for name in ("io_threads", "read_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not _power_of_two(self.block_bytes) or self.block_bytes < 4096:
            raise ValueError(f"block_bytes must be a power of two >= 4096, got {self.block_bytes}")
        if not _power_of_two(self.slab_bytes) or self.slab_bytes < self.block_bytes:
            raise ValueError(f"slab_bytes must be a power of two >= block_bytes ({self.block_bytes}), got {self.slab_bytes}")
        if not _power_of_two(self.read_chunk_bytes) or self.read_chunk_bytes < 4096:
            raise ValueError(f"read_chunk_bytes must be a power of two >= 4096, got {self.read_chunk_bytes}")
        if self.commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be positive, got {self.commit_timeout_s}")


def group_rank_and_size(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)
