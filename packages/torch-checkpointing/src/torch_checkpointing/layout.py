"""A rank's layout (what it stores, where each piece sits in the global tensors) and the global one.

The layout depends only on structure (paths, dtypes, global shapes, placements, meshes), never on
values, so it is computed once and reused while the structure stays the same: `layout_key` is the
cheap per-save check, the fingerprint its stable digest that other processes can compare.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .file_format import FORMAT, VERSION, dtype_name, to_json
from .local_chunks import HOOKS, has_checkpoint_hooks, hook_chunks
from .sharding import Box, dtensor_boxes, plain_owner
from .state_tree import Leaf


def matches_prefix(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def leaf_kind(leaf: Leaf, per_rank: tuple[str, ...]) -> str:
    """"dtensor", "tensor" (replicated plain tensor), "rank_tensor", "bytes" or "value"."""
    value = leaf.value
    if isinstance(value, DTensor):
        if matches_prefix(leaf.path, per_rank):
            raise ValueError(f"{leaf.path!r} is a DTensor, so it cannot be per_rank (its placements say who holds what)")
        return "dtensor"
    if isinstance(value, torch.Tensor):
        if has_checkpoint_hooks(leaf.path, value):
            # its pieces have global offsets, but the global shape is not known on a rank holding none
            raise TypeError(
                f"{leaf.path!r} is a {type(value).__name__} implementing {', '.join(HOOKS)} outside a DTensor; "
                "wrap it in a DTensor (DTensor.from_local(..., shape=global shape)) so every rank knows its global shape"
            )
        return "rank_tensor" if matches_prefix(leaf.path, per_rank) else "tensor"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    return "value"


def layout_key(leaves: list[Leaf], kinds: list[str]) -> tuple:
    """Everything a layout depends on, as a hashable tuple; equal keys mean an equal layout."""
    key: list[Any] = []
    for leaf, kind in zip(leaves, kinds):
        t = leaf.value
        if kind == "dtensor":
            local = t._local_tensor
            # a local tensor with checkpoint hooks names its pieces itself: they are part of the layout
            pieces = tuple(hook_chunks(leaf.path, t, saving=True)) if has_checkpoint_hooks(leaf.path, local) else None
            key.append((leaf.path, kind, t.dtype, tuple(t.shape), tuple(t.placements), t.device_mesh,
                        local.device, local.stride(), pieces))
        elif kind == "tensor":
            key.append((leaf.path, kind, t.dtype, tuple(t.shape), t.device, t.stride()))
        else:
            key.append((leaf.path, kind))
    return tuple(key)


@dataclass(slots=True)
class Piece:
    """One tensor in the rank's data file: a box of a leaf's local tensor."""

    name: str
    path: str
    leaf: int
    box: Box
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(slots=True)
class RankLayout:
    pieces: list[Piece]
    record: dict  # the JSON layout this rank publishes (exchanged, and kept in its record file)
    fingerprint: str
    rank_paths: list[str] = field(default_factory=list)  # per-rank entries (values, bytes, rank tensors)


def build_rank_layout(leaves: list[Leaf], kinds: list[str], *, rank: int, world_size: int) -> RankLayout:
    pieces: list[Piece] = []
    tensors: dict[str, dict] = {}
    rank_paths: list[str] = []
    for index, (leaf, kind) in enumerate(zip(leaves, kinds)):
        if kind in ("rank_tensor", "bytes", "value"):
            rank_paths.append(leaf.path)
            continue
        t = leaf.value
        if kind == "dtensor":
            boxes, writes = dtensor_boxes(leaf.path, t, saving=True)
        else:
            boxes = [Box((0,) * t.dim(), tuple(t.shape), (0,) * t.dim())]
            writes = plain_owner(leaf.path, world_size) == rank
            if t.numel() == 0:
                boxes = []
        dtype = dtype_name(t.dtype, leaf.path)
        chunks = []
        if writes:
            for i, box in enumerate(boxes):
                name = leaf.path if len(boxes) == 1 else f"{leaf.path}@{','.join(map(str, box.offset))}"
                pieces.append(Piece(name, leaf.path, index, box, t.dtype, box.shape,
                                    box.numel * t.element_size()))
                chunks.append({"name": name, "offset": list(box.offset), "shape": list(box.shape)})
        tensors[leaf.path] = {"dtype": dtype, "shape": list(t.shape), "chunks": chunks}
    record = {"rank": rank, "world_size": world_size, "tensors": tensors, "per_rank": rank_paths}
    fingerprint = hashlib.blake2b(to_json(record), digest_size=8).hexdigest()
    return RankLayout(pieces, record, fingerprint, rank_paths)


def merge_layouts(layouts: list[dict], record_names: list[str]) -> dict:
    """The global metadata of a step from every rank's layout; raises when ranks disagree."""
    world_size = len(layouts)
    first = layouts[0]
    for layout in layouts:
        if layout["world_size"] != world_size:
            raise ValueError(f"rank {layout['rank']} saved with world size {layout['world_size']}, but {world_size} ranks took part")
        if set(layout["tensors"]) != set(first["tensors"]) or layout["per_rank"] != first["per_rank"]:
            a, b = set(first["tensors"]) | set(first["per_rank"]), set(layout["tensors"]) | set(layout["per_rank"])
            raise ValueError(
                f"ranks 0 and {layout['rank']} save different state entries: only on rank 0: "
                f"{sorted(a - b)[:8]}, only on rank {layout['rank']}: {sorted(b - a)[:8]}"
            )
    tensors: dict[str, dict] = {}
    for path, entry in first["tensors"].items():
        merged = {"dtype": entry["dtype"], "shape": entry["shape"], "chunks": []}
        covered = 0
        for layout in layouts:
            other = layout["tensors"][path]
            if other["dtype"] != entry["dtype"] or other["shape"] != entry["shape"]:
                raise ValueError(
                    f"{path!r} is {entry['dtype']}{entry['shape']} on rank 0 but "
                    f"{other['dtype']}{other['shape']} on rank {layout['rank']}"
                )
            for chunk in other["chunks"]:
                if any(o < 0 or o + s > n for o, s, n in zip(chunk["offset"], chunk["shape"], entry["shape"])):
                    raise ValueError(f"{path!r}: rank {layout['rank']}'s chunk at {chunk['offset']} lies outside {entry['shape']}")
                covered += _numel(chunk["shape"])
                merged["chunks"].append({"rank": layout["rank"], **chunk})
        # Chunks come from placements, so they never overlap unless ranks disagree about them;
        # then the element count is off as well (an overlap leaves a gap elsewhere).
        if covered != _numel(entry["shape"]):
            raise ValueError(
                f"{path!r}: the ranks' chunks hold {covered} of its {_numel(entry['shape'])} elements; "
                "do all ranks agree on its mesh and placements?"
            )
        tensors[path] = merged
    return {
        "format": FORMAT, "version": VERSION, "world_size": world_size,
        "tensors": tensors, "per_rank": first["per_rank"], "records": record_names,
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
