"""The one place dist-moe reads device data on the host, so the reads can be counted.

On a GPU every such read is a host-device synchronisation. The Triton path of a MoE layer reads
exactly once per forward and only under expert parallelism (the all-to-all split sizes);
the backward reuses those sizes and reads nothing. The torch (CPU reference) expert path also
reads the per-expert row counts once per forward, to slice its loop.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

from torch import Tensor

_local = threading.local()


@dataclass
class HostReads:
    """What `count_host_syncs` saw: the number of reads and why each happened."""

    reasons: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.reasons)


def read_to_host(tensor: Tensor, reason: str) -> list:
    """tensor.tolist(), recorded in every active `count_host_syncs` of this thread."""
    for counter in getattr(_local, "counters", ()):
        counter.reasons.append(reason)
    return tensor.tolist()


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostReads]:
    """Record every host read dist-moe makes inside the block (per thread)."""
    counters = getattr(_local, "counters", None)
    if counters is None:
        counters = _local.counters = []
    reads = HostReads()
    counters.append(reads)
    try:
        yield reads
    finally:
        counters.remove(reads)
