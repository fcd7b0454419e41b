"""Which block saves what: explicit lists, or the least recomputation whose saved bytes fit a budget.

Each block has options (keep everything; keep products and attention; keep attention; keep only its
input and recompute all), each with planned saved bytes and recomputed FLOPs (measure.py: keep saves what
autograd saves in the block's forward, the others its input and the listed ops' outputs). Under a memory
budget the choice is a multiple-choice knapsack solved exactly by dynamic programming over the blocks,
with bytes rounded up to a grid of at most ~4000 steps (so the plan never exceeds the budget).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from .measure import ATTENTION_OPS, MATMUL_OPS, BlockProfile

GIB = 1 << 30
# option name -> the op names it saves (None: everything, no checkpoint)
OPTIONS: dict[str, tuple[str, ...] | None] = {
    "keep": None,
    "save_matmuls_attention": MATMUL_OPS + ATTENTION_OPS,
    "save_attention": ATTENTION_OPS,
    "recompute": (),
}


@dataclass(frozen=True)
class BlockChoice:
    path: str
    option: str
    """keep, save_matmuls_attention, save_attention, recompute, or explicit."""
    save_ops: tuple[str, ...] | None
    """The op names whose outputs are saved (None: the block is not checkpointed)."""
    saved_bytes: int
    recomputed_flops: int


def cost(profile: BlockProfile, save_ops: tuple[str, ...] | None) -> tuple[int, int]:
    """(saved bytes, recomputed FLOPs) of checkpointing `profile` keeping `save_ops` (None: no checkpoint)."""
    if save_ops is None:
        return profile.keep_bytes, 0
    kept = [op for op in profile.ops if _matches(op.name, save_ops)]
    return profile.input_bytes + sum(op.bytes for op in kept), sum(op.flops for op in profile.ops
                                                                      if not _matches(op.name, save_ops))


def _matches(name: str, save_ops: tuple[str, ...]) -> bool:
    if name == "attention":  # measure.py records the fused attention op under this name
        return any(s in ATTENTION_OPS for s in save_ops)
    return name in save_ops


def normalize_op(name: str) -> str:
    """'aten.mm.default', 'aten.mm' or 'mm' -> 'mm'."""
    parts = name.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]


def explicit_plan(profiles: list[BlockProfile], save_ops: tuple[str, ...],
                  save_blocks: tuple[str, ...]) -> list[BlockChoice]:
    ops = tuple(normalize_op(o) for o in save_ops)
    unmatched = [p for p in save_blocks if not any(fnmatch.fnmatchcase(b.path, p) for b in profiles)]
    if unmatched:
        raise ValueError(f"activation_checkpoint.save_blocks: no block matches {', '.join(unmatched)} "
                         f"(blocks are {profiles[0].path} .. {profiles[-1].path})")
    choices = []
    for b in profiles:
        keep = any(fnmatch.fnmatchcase(b.path, p) for p in save_blocks)
        saved, flops = cost(b, None if keep else ops)
        choices.append(BlockChoice(b.path, "keep" if keep else "explicit", None if keep else ops, saved, flops))
    return choices


def budget_plan(profiles: list[BlockProfile], budget_bytes: int,
                prefix_caps: list[int] | None = None) -> list[BlockChoice]:
    """The choices with the least recomputed FLOPs whose saved bytes sum to at most `budget_bytes`, and those of
    blocks 0..i to at most prefix_caps[i] (the backward's walk, peak.py)."""
    options = [[BlockChoice(b.path, name, ops, *cost(b, ops)) for name, ops in OPTIONS.items()] for b in profiles]
    least = sum(min(c.saved_bytes for c in opts) for opts in options)
    if least > budget_bytes:
        raise ValueError(f"activation_checkpoint.memory_budget_gib leaves {budget_bytes / GIB:.3f} GiB for "
                         f"activations; recomputing every block still saves {least / GIB:.3f} GiB: raise the "
                         "budget, or shrink the microbatch (training.grad_accum_steps)")
    unit = max(1, math.ceil(budget_bytes / 4000))
    slots = budget_bytes // unit
    caps = [slots] * len(profiles) if prefix_caps is None else [min(slots, c // unit) for c in prefix_caps]
    best: dict[int, tuple[int, list[BlockChoice]]] = {0: (0, [])}  # used units -> (flops, choices)
    for opts, cap in zip(options, caps, strict=True):
        nxt: dict[int, tuple[int, list[BlockChoice]]] = {}
        for used, (flops, chosen) in best.items():
            for c in opts:
                u = used + math.ceil(c.saved_bytes / unit)
                if u <= cap and (u not in nxt or flops + c.recomputed_flops < nxt[u][0]):
                    nxt[u] = (flops + c.recomputed_flops, chosen + [c])
        best = nxt
        if not best:
            raise ValueError(f"activation_checkpoint.memory_budget_gib: recomputing every block still exceeds the "
                             f"budget in the backward at {opts[0].path}: raise the budget")
    return min(best.values(), key=lambda v: v[0])[1]
