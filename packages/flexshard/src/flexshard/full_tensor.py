"""`full_tensor`: assemble any flexshard (or plain DTensor) parameter on every rank (a collective)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .chunked import ChunkedShard
from .collectives import all_gather_single


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank. RowShard / fully_shard DTensors use DTensor's own gather;
    Owned / BlockShard ones (a `ChunkedShard` local) one padded all-gather of the flat pieces."""
    if not isinstance(t, DTensor):
        return t
    local = t._local_tensor
    if not isinstance(local, ChunkedShard):
        return t.full_tensor()
    layout, world = local._layout, t.device_mesh.size()
    longest = max(layout.local_numel(r) for r in range(world))
    send = local._data.new_zeros(max(longest, 1))
    send[: local._data.numel()] = local._data
    recv = send.new_empty(world * send.numel())
    all_gather_single(recv, send, group=t.device_mesh.get_group())
    pieces = recv.view(world, -1)
    return layout.full_from_locals([pieces[r, : layout.local_numel(r)] for r in range(world)])
