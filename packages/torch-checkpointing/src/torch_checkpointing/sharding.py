"""Which part of a global tensor a rank holds, as boxes, computed from DTensor placements.

A box is a dense sub-block of the global tensor: `offset` and `shape` in global coordinates, and
`local_offset` where it sits in the rank's local tensor. Shard and Replicate give one box per rank;
a strided shard (FSDP2 + TP's _StridedShard) gives one box per contiguous run of global indices.
A local tensor that implements DCP's checkpoint hooks (local_chunks.py) names its boxes itself;
they have no local_offset, and their tensors come from the hooks.
Nothing here communicates: every rank computes its own boxes, and which replica writes a replicated
box, from the mesh coordinate.
"""
from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .local_chunks import has_checkpoint_hooks, hook_chunks, hook_view

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # older torch: no strided shards to handle
    _StridedShard = None

Run = tuple[int, int]  # (global start, length) of consecutive global indices along one dim


@dataclass(frozen=True, slots=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...] | None  # None: the local tensor's __get_tensor_shard__ gives the box

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_slices(self) -> tuple[slice, ...]:
        assert self.local_offset is not None
        return tuple(slice(o, o + s) for o, s in zip(self.local_offset, self.shape))


def box_view(path: str, local: torch.Tensor, box: Box) -> torch.Tensor:
    """The box's elements in the local tensor (a view sharing its storage), detached."""
    if box.local_offset is None:
        return hook_view(path, local, box.offset, box.shape).detach()
    return local[box.local_slices()].detach()


def _select_positions(runs: list[Run], start: int, stop: int) -> list[Run]:
    """The runs covering positions [start, stop) of the index list the runs spell out."""
    out, pos = [], 0
    for run_start, length in runs:
        lo, hi = max(start, pos), min(stop, pos + length)
        if lo < hi:
            out.append((run_start + lo - pos, hi - lo))
        pos += length
    return out


def _runs_of(indices: list[int]) -> list[Run]:
    runs: list[Run] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _apply_shard(runs: list[Run], placement, num_chunks: int, index: int, ndim: int, path: str) -> list[Run]:
    length = sum(n for _, n in runs)
    if type(placement) is Shard:
        # torch.chunk semantics (what Shard promises): ceil-sized pieces, trailing ones may be empty
        full = -(-length // num_chunks)
        start = min(index * full, length)
        return _select_positions(runs, start, min(start + full, length))
    # Other shard-like placements (strided shards): ask the placement to split a probe of positions
    # the way it splits data, so its own rule decides (no copy of torch's logic to drift).
    dim = placement.dim % ndim
    probe = torch.arange(length).reshape([length if d == dim else 1 for d in range(ndim)])
    pieces, _ = placement._split_tensor(probe, num_chunks, with_padding=False, contiguous=False)
    positions = pieces[index].reshape(-1).tolist()
    flat = [s + k for s, n in runs for k in range(n)]
    return _runs_of([flat[p] for p in positions])


def dtensor_boxes(path: str, tensor: DTensor, *, saving: bool = False) -> tuple[list[Box], bool]:
    """(boxes this rank holds, whether this rank writes them: one replica per replicated mesh dim).

    saving: for a local tensor with checkpoint hooks, the boxes it asks to save (its write items)
    rather than those it holds (its chunk list), as DCP's planners do.
    """
    mesh, placements = tensor.device_mesh, tensor.placements
    hooks = has_checkpoint_hooks(path, tensor._local_tensor)
    shape = tuple(tensor.shape)
    ndim = len(shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return [], False
    runs: list[list[Run]] = [[(0, n)] for n in shape]
    writer = True
    for mesh_dim, placement in enumerate(placements):
        size, index = mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(placement, Replicate):
            # the replica that writes is spread by path so replicated tensors share the write load
            writer &= index == (zlib.crc32(path.encode()) + mesh_dim) % size
        elif isinstance(placement, Partial):
            raise ValueError(
                f"DTensor {path!r} has a Partial placement (pending reduction); redistribute it to "
                "Shard or Replicate before checkpointing"
            )
        elif hooks:
            continue  # the local tensor describes its pieces itself; only replication matters here
        elif (_StridedShard is not None and isinstance(placement, _StridedShard)) or isinstance(placement, Shard):
            dim = placement.dim % ndim
            runs[dim] = _apply_shard(runs[dim], placement, size, index, ndim, path)
        else:
            raise ValueError(
                f"DTensor {path!r} has placement {placement!r}; supported: Shard, _StridedShard, Replicate "
                "(any placement when the local tensor implements DCP's checkpoint hooks)"
            )
    if hooks:
        chunks = hook_chunks(path, tensor, saving=saving)
        return [Box(offset, size, None) for offset, size in chunks if math.prod(size)], writer
    local_shape = tuple(sum(n for _, n in r) for r in runs)
    if local_shape != tuple(tensor._local_tensor.shape):
        raise ValueError(
            f"DTensor {path!r}: local tensor shape {tuple(tensor._local_tensor.shape)} does not match its "
            f"placements {placements} on mesh {tuple(mesh.shape)} (expected {local_shape})"
        )
    boxes = []
    for combo in itertools.product(*[_with_local_starts(r) for r in runs]):
        box = Box(
            offset=tuple(start for start, _, _ in combo),
            shape=tuple(n for _, n, _ in combo),
            local_offset=tuple(local for _, _, local in combo),
        )
        if box.numel:  # a 0-dim tensor is one box of shape (); empty shards store nothing
            boxes.append(box)
    return boxes, writer


def _with_local_starts(runs: list[Run]) -> list[tuple[int, int, int]]:
    out, local = [], 0
    for start, n in runs:
        out.append((start, n, local))
        local += n
    return out


def plain_owner(path: str, world_size: int) -> int:
    """The rank that writes a replicated plain tensor: spread by path, the same on every rank."""
    return zlib.crc32(path.encode()) % world_size
