"""Where each element of a parameter lives: a list of rectangles per rank.

Every placement reduces to the same description: rank r holds `rects[r]`, rectangles of the
parameter stored back to back (each row-major) in one flat local tensor. Every element lives on
exactly one rank, so local sums (norms, losses) add up to the global value.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from .placements import BlockShard, Owned, Placement, RowShard


@dataclass(frozen=True)
class Rect:
    """A rectangular piece of a parameter: `param[offsets[0]:offsets[0]+sizes[0], ...]`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


@dataclass(frozen=True)
class ParamLayout:
    """The placement of one parameter over `world` ranks."""

    shape: tuple[int, ...]
    placement: Placement
    rects: tuple[tuple[Rect, ...], ...]  # rects[r]: rank r's pieces, in storage order

    @property
    def world(self) -> int:
        return len(self.rects)

    def local_numel(self, rank: int) -> int:
        return sum(r.numel for r in self.rects[rank])

    @property
    def row_slot_numel(self) -> int:
        """RowShard: the padded per-rank element count (ceil(rows/W) rows), equal on every rank."""
        assert isinstance(self.placement, RowShard)
        return math.ceil(self.shape[0] / self.world) * math.prod(self.shape[1:])

    def tiles(self, rank: int) -> int:
        """BlockShard: number of whole tiles rank `rank` holds (one quantization scale each)."""
        assert isinstance(self.placement, BlockShard)
        br, bc = self.placement.block
        return sum(math.ceil(r.sizes[0] / br) * math.ceil(r.sizes[1] / bc) for r in self.rects[rank])

    def owner(self) -> int | None:
        """Owned: the owning rank."""
        return next((r for r, rects in enumerate(self.rects) if rects), None)

    def local_from_full(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s flat local storage [local_numel], copied out of the full tensor."""
        pieces = [full[r.slices].reshape(-1) for r in self.rects[rank]]
        if not pieces:
            return full.new_empty((0,))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

    def full_from_locals(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `local_from_full`: the full tensor from every rank's flat local storage."""
        full = locals_[0].new_empty(self.shape)
        for rank, data in enumerate(locals_):
            offset = 0
            for r in self.rects[rank]:
                full[r.slices] = data[offset : offset + r.numel].view(r.sizes)
                offset += r.numel
        return full


def row_rects(shape: tuple[int, ...], world: int) -> tuple[tuple[Rect, ...], ...]:
    rows, rest = shape[0], shape[1:]
    chunk = math.ceil(rows / world)
    out = []
    for rank in range(world):
        start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        out.append((Rect((start,) + (0,) * len(rest), (stop - start,) + rest),))
    return tuple(out)


def owned_rects(shape: tuple[int, ...], world: int, owner: int) -> tuple[tuple[Rect, ...], ...]:
    whole = Rect((0,) * len(shape), shape)
    return tuple((whole,) if rank == owner else () for rank in range(world))


def block_rects(shape: tuple[int, ...], world: int, block: tuple[int, int]) -> tuple[tuple[Rect, ...], ...]:
    """Contiguous runs of tiles (row-major tile order) per rank, each run as at most 3 rectangles:
    the tail of a tile row, whole tile rows, the head of a tile row."""
    rows, cols = shape
    br, bc = block
    n_tile_rows, n_tile_cols = math.ceil(rows / br), math.ceil(cols / bc)
    n_tiles = n_tile_rows * n_tile_cols
    base, extra = divmod(n_tiles, world)

    def rect(tile_row0: int, tile_row1: int, tile_col0: int, tile_col1: int) -> Rect:
        r0, r1 = tile_row0 * br, min(tile_row1 * br, rows)
        c0, c1 = tile_col0 * bc, min(tile_col1 * bc, cols)
        return Rect((r0, c0), (r1 - r0, c1 - c0))

    out = []
    for rank in range(world):
        t0 = rank * base + min(rank, extra)
        t1 = t0 + base + (rank < extra)
        pieces: list[Rect] = []
        if t1 > t0:
            (i0, j0), (i1, j1) = divmod(t0, n_tile_cols), divmod(t1, n_tile_cols)
            if i0 == i1:
                pieces.append(rect(i0, i0 + 1, j0, j1))
            else:
                if j0 > 0:
                    pieces.append(rect(i0, i0 + 1, j0, n_tile_cols))
                    i0 += 1
                if i1 > i0:
                    pieces.append(rect(i0, i1, 0, n_tile_cols))
                if j1 > 0:
                    pieces.append(rect(i1, i1 + 1, 0, j1))
        out.append(tuple(pieces))
    return tuple(out)


# Elements owned per rank across all shard() calls on one mesh, so per-bucket balancing also evens
# out the whole model (every rank makes the same calls in the same order, so this stays in sync).
_owner_load: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def assign_owners(numels: list[int], fixed: list[int | None], world: int, mesh: object) -> list[int]:
    """Owners for a bucket's Owned parameters (`fixed[i]` set: that rank).

    Two goals: even segments within the bucket (the all-gather pads every rank to the largest) and
    an even total over the model (the optimizer step waits for the busiest owner). So: pack the
    bucket into `world` bins, largest first into the lightest bin, then give the heaviest bin to
    the rank with the least load from earlier buckets on this mesh. With repeated layers the
    uneven bins rotate over the ranks instead of always landing on the same one.
    """
    try:
        total = _owner_load.setdefault(mesh, [0] * world)
    except TypeError:  # a mesh that cannot be weakly referenced: balance within the bucket only
        total = [0] * world
    for rank in fixed:
        if rank is not None and not 0 <= rank < world:
            raise ValueError(f"Owned(rank={rank}) is outside the mesh (ranks 0..{world - 1})")
    pinned = any(rank is not None for rank in fixed)  # pinned parameters tie bins to ranks
    load = [0] * world  # per bin
    owners = [0] * len(numels)
    for i, rank in enumerate(fixed):
        if rank is not None:
            owners[i] = rank
            load[rank] += numels[i]
    bin_of = {}
    for i in sorted((i for i in range(len(numels)) if fixed[i] is None), key=lambda i: (-numels[i], i)):
        bin_of[i] = min(range(world), key=lambda b: (load[b], b))
        load[bin_of[i]] += numels[i]
    rank_of_bin = list(range(world))
    if not pinned:
        by_load = sorted(range(world), key=lambda b: (-load[b], b))
        by_total = sorted(range(world), key=lambda r: (total[r], r))
        for b, r in zip(by_load, by_total):
            rank_of_bin[b] = r
    for i, b in bin_of.items():
        owners[i] = rank_of_bin[b]
    for i, n in enumerate(numels):
        total[owners[i]] += n
    return owners


def make_layout(shape: tuple[int, ...], placement: Placement, world: int, owner: int | None = None) -> ParamLayout:
    if isinstance(placement, RowShard):
        rects = row_rects(shape, world)
    elif isinstance(placement, Owned):
        assert owner is not None and 0 <= owner < world
        rects = owned_rects(shape, world, owner)
    elif isinstance(placement, BlockShard):
        rects = block_rects(shape, world, placement.block)
    else:  # pragma: no cover - resolve_placement rejects anything else
        raise TypeError(placement)
    return ParamLayout(shape=tuple(shape), placement=placement, rects=rects)
