"""Which block saves what: explicit lists, or the least recomputation whose saved bytes fit a budget.

Each block has options (keep everything; keep products and attention; keep attention; keep only its
input and recompute all), each with planned saved bytes, high marks and recomputed FLOPs, every option
measured alike: what the block holds when run under that option's checkpoint and policy (held.py). Under a
memory budget the choice is a multiple-choice knapsack solved exactly by dynamic programming over the blocks,
with bytes rounded up to a grid of at most ~4000 steps (so the plan never exceeds the budget); each option's
high marks are checked against the budget where the block runs (peak.py).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from .measure import BlockProfile
from .ops import ATTENTION_OPS, MATMUL_OPS

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
    forward_peak_bytes: int | None = None
    """The block's high mark in its forward (its input and working set; held.py); None: not measured."""
    backward_transient_bytes: int | None = None
    """Its backward's high mark less saved_bytes: what it recomputes and the gradients in flight; None: not
    measured (peak.py then reserves one constant transient for every block)."""
    grad_share: float = 1.0
    """Of the block's weight gradients, the share made by its backward's high mark (held.py)."""


def cost(profile: BlockProfile, save_ops: tuple[str, ...] | None) -> tuple[int, int]:
    """(saved bytes, recomputed FLOPs) of checkpointing `profile` keeping `save_ops` (None: no checkpoint);
    saved bytes as measured under that option (held.py), or for hand-made profiles the input and listed ops'
    outputs (every op's output when kept)."""
    flops = 0 if save_ops is None else sum(op.flops for op in profile.ops if not _matches(op.name, save_ops))
    held = profile.held.get(save_ops)
    if held is not None:
        return held.saved_bytes, flops
    if save_ops is None:
        return profile.keep_bytes, 0
    return profile.input_bytes + sum(op.bytes for op in profile.ops if _matches(op.name, save_ops)), flops


def choose(profile: BlockProfile, option: str, save_ops: tuple[str, ...] | None,
           transient: int | None = None) -> BlockChoice:
    """The block under `save_ops` with its measured high marks; unmeasured (hand-made): `transient`."""
    held = profile.held.get(save_ops)
    if held is None:
        return BlockChoice(profile.path, option, save_ops, *cost(profile, save_ops), None, transient)
    saved, flops = cost(profile, save_ops)
    return BlockChoice(profile.path, option, save_ops, saved, flops, held.forward_peak_bytes,
                       max(held.backward_peak_bytes - saved, 0), held.grad_share)


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
        choices.append(choose(b, "keep" if keep else "explicit", None if keep else ops))
    return choices


def budget_plan(profiles: list[BlockProfile], budget_bytes: int, prefix_caps: list[int] | None = None,
                forward_cap: int | None = None, transient: int | None = None,
                own_gradients: list[int] | None = None) -> list[BlockChoice]:
    """The choices with the least recomputed FLOPs whose saved bytes sum to at most `budget_bytes`; with
    prefix_caps (the backward's walk, peak.py), those of blocks 0..i with block i's backward transient to at
    most prefix_caps[i]; with forward_cap, those of blocks 0..i-1 with block i's forward high mark to at most
    it. transient: the backward transient of unmeasured (hand-made) profiles; own_gradients[i]: block i's
    weight gradients, made during its backward (its choice's grad_share of them at its high mark)."""
    options = [[choose(b, name, ops, transient) for name, ops in OPTIONS.items()] for b in profiles]
    least = sum(min(c.saved_bytes for c in opts) for opts in options)
    if least > budget_bytes:
        raise ValueError(f"activation_checkpoint.memory_budget_gib leaves {budget_bytes / GIB:.3f} GiB for "
                         f"activations; recomputing every block still saves {least / GIB:.3f} GiB: raise the "
                         "budget, or shrink the microbatch (training.grad_accum_steps)")
    unit = max(1, math.ceil(budget_bytes / 4000))
    slots = budget_bytes // unit
    # the walk's caps hold the block's transient besides the saved units: not clipped to the total's slots
    caps = [None] * len(profiles) if prefix_caps is None else [c // unit for c in prefix_caps]
    best: dict[int, tuple[int, list[BlockChoice]]] = {0: (0, [])}  # used units -> (flops, choices)
    own = own_gradients or [0] * len(profiles)
    for opts, cap, grads in zip(options, caps, own, strict=True):
        nxt: dict[int, tuple[int, list[BlockChoice]]] = {}
        for used, (flops, chosen) in best.items():
            for c in opts:
                u = used + math.ceil(c.saved_bytes / unit)
                if u > slots or not _fits(c, used, u, cap, unit, forward_cap, grads):
                    continue
                if u not in nxt or flops + c.recomputed_flops < nxt[u][0]:
                    nxt[u] = (flops + c.recomputed_flops, chosen + [c])
        best = nxt
        if not best:
            raise ValueError(f"activation_checkpoint.memory_budget_gib: recomputing every block still exceeds the "
                             f"budget in the backward at {opts[0].path}: raise the budget")
    return min(best.values(), key=lambda v: v[0])[1]


def _fits(c: BlockChoice, used: int, u: int, cap: int | None, unit: int, forward_cap: int | None,
          grads: int) -> bool:
    """Block c's walk and forward constraints with `used` units saved before it and `u` through it."""
    backward = (c.backward_transient_bytes or 0) + math.ceil(c.grad_share * grads)
    if cap is not None and u + math.ceil(backward / unit) > cap:
        return False
    if forward_cap is not None and c.forward_peak_bytes is not None:
        return used + math.ceil(c.forward_peak_bytes / unit) <= forward_cap // unit
    return True
