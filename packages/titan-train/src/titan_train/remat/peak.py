"""The remat planner's peak model: what a step holds besides the saved activations, and when.

With training.grad_accum_steps == 1 the trainer's zero_grad(set_to_none=True) leaves no gradient through
the forward, when every saved activation is alive; the gradients appear in the backward while the blocks'
saved activations are freed, last block first. So the step's high mark is the largest of
  forward   forward_bytes (weights, fp32 masters, AdamW moments) + every saved activation + the largest of
            one block's transient, the fused loss's buffers at its last chunk, and those buffers less the
            chunk's logits with the gradients made before the blocks' (the output head's and the final
            norm's: they appear at the backward's start, while the loss's other buffers are still held);
  backward  at each block, walking backward: forward_bytes + the gradients made so far (the head's, this
            block's and the later blocks'; the embedding's comes after every block) + the activations still
            saved (this block's and the earlier blocks') + one block's transient;
  end       forward_bytes + every gradient: what the clip and the optimizer step start from.
With accumulation (grad_accum_steps > 1) the gradients persist across microbatches: forward_bytes holds
them and the backward adds none. No plan fits below the larger of the end and the backward's walk at the
first block under its cheapest option (backward_floor).

Each block's transients are its own, for the option it takes (held.py, measured under that option): in the
forward, its high mark on top of the blocks before it (checked at every block, not only at the end); in the
backward, its high mark less what it saved (what a checkpoint recomputes for it and the gradients in flight),
at its point of the walk, with the share of its weights' gradients made by then (held.py). So a recomputed
block next to kept ones is charged its recomputation, not one kept block's bytes. Hand-made profiles (no
measurement) take one constant transient for every block: the largest block's keep bytes. Each point of the
walk caps the saved bytes of blocks 0..i with that block's transient, which the knapsack (plan.budget_plan)
keeps to: the walk may peak inside when blocks saving more than their gradients come before blocks saving
less.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .measure import BlockProfile
from .plan import GIB, OPTIONS, BlockChoice, budget_plan, choose, cost

# The trainer's plan aims this fraction of the budget under it (planned_under_budget): the step's measured peak
# on the H200 was within -0.95 to +0.09 GiB of the peak model's over the 14 plans of the 8B measured at batches
# 2-24 (allocator rounding, buffers the model approximates; docs/benchmarks.md); 0.2% is 0.28 GiB at 138 GiB,
# three times the largest excess.
PLAN_HEADROOM = 0.002


@dataclass(frozen=True)
class StaticMemory:
    """A rank's bytes besides the saved activations, as the planner counts them."""

    forward_bytes: int
    """Held through the whole forward: weights, fp32 masters and AdamW moments (with grad_accum_steps > 1 the
    gradients too), and under autocast the bf16 weight copies kept blocks save."""
    gradient_bytes: int
    """Every gradient (this rank's shards), all alive at the end of the backward."""
    gradients_persist: bool
    """grad_accum_steps > 1: the gradients are already in forward_bytes."""
    loss_bytes: int = 0
    """The fused loss's buffers at its last chunk: the chunk's logits and their gradient, the output weight's
    gradient sum, the hidden states' gradient, the final norm's input and output."""
    loss_chunk_bytes: int = 0
    """Of loss_bytes, the chunk's logits and gradient: freed before the backward starts, when the output
    head's gradient appears beside the rest."""
    late_gradient_bytes: int = 0
    """Of the gradients outside the blocks, those made only after every block's backward: the (untied)
    embedding's. The others (the output head's, the final norm's) are made before the blocks'."""

    def early_gradients(self, outside: int) -> int:
        """Of `outside` (the gradients outside the blocks), those alive from the backward's start."""
        return 0 if self.gradients_persist else outside - self.late_gradient_bytes

    def forward_reserve(self, transient: int, outside: int) -> int:
        """What the forward's end holds besides the state and the saved activations: one block's transient, the
        loss's last chunk, or the loss's buffers with the head's gradient at the backward's start."""
        return max(transient, self.loss_bytes,
                   self.loss_bytes - self.loss_chunk_bytes + self.early_gradients(outside))

    @property
    def end_of_backward_bytes(self) -> int:
        return self.forward_bytes + (0 if self.gradients_persist else self.gradient_bytes)


@dataclass(frozen=True)
class PeakModel:
    forward_bytes: int
    backward_bytes: int
    end_of_backward_bytes: int

    @property
    def total_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes, self.end_of_backward_bytes)


def block_transient(profiles: list[BlockProfile]) -> int:
    """The constant backward headroom of unmeasured profiles: the largest block's keep bytes; 0 when every
    profile is measured (each choice then carries its own, held.py)."""
    if all(b.held for b in profiles):
        return 0
    return max((cost(b, None)[0] for b in profiles), default=0)


def peak_model(choices: list[BlockChoice], block_gradients: list[int], memory: StaticMemory,
               transient: int = 0) -> PeakModel:
    """The plan's high marks; block_gradients[i]: the gradient bytes of block i's parameters. Each choice's
    own transients where measured, else the constant `transient`."""
    outside = memory.gradient_bytes - sum(block_gradients)
    alive = sum(c.saved_bytes for c in choices)
    forward = max([memory.forward_bytes + alive + memory.forward_reserve(transient, outside),
                   *(f for f in forward_walk(choices, memory) if f is not None)])
    backward = max(backward_walk(choices, block_gradients, memory, transient), default=0)
    return PeakModel(forward, backward, memory.end_of_backward_bytes)


def forward_walk(choices: list[BlockChoice], memory: StaticMemory) -> list[int | None]:
    """Per block, the high mark of its forward: the state, the blocks before it saved, its own high mark
    (None: not measured)."""
    marks, before = [], 0
    for c in choices:
        marks.append(None if c.forward_peak_bytes is None else memory.forward_bytes + before + c.forward_peak_bytes)
        before += c.saved_bytes
    return marks


def backward_walk(choices: list[BlockChoice], block_gradients: list[int], memory: StaticMemory,
                  transient: int = 0) -> list[int]:
    """Per block, the high mark of its backward: the state, the gradients made by then (the head's, the later
    blocks', its own share), what it and the blocks before it saved, and its transient."""
    grads, made = _walk_gradients(memory, block_gradients)
    alive = sum(c.saved_bytes for c in choices)
    marks = [0] * len(choices)
    for i in reversed(range(len(choices))):
        marks[i] = _backward_mark(choices[i], made, alive, grads[i], memory, transient)
        made += grads[i]
        alive -= choices[i].saved_bytes
    return marks


def _walk_gradients(memory: StaticMemory, block_gradients: list[int]) -> tuple[list[int], int]:
    """The gradients the backward adds per block (none when they persist through accumulation) and those made
    before the last block's backward (the head's and the final norm's)."""
    grads = [0] * len(block_gradients) if memory.gradients_persist else block_gradients
    return grads, memory.early_gradients(memory.gradient_bytes - sum(block_gradients))


def _backward_mark(choice: BlockChoice, made: int, alive: int, own_gradients: int, memory: StaticMemory,
                   transient: int) -> int:
    """One block's point of the walk: `made` gradients before its backward, `alive` saved bytes (its own and
    the earlier blocks'), its share of its own gradients at its high mark, and its transient."""
    own = choice.backward_transient_bytes
    share = 1.0 if own is None else choice.grad_share  # unmeasured: all its gradients at its high mark
    return (memory.forward_bytes + made + math.ceil(share * own_gradients) + alive
            + (transient if own is None else own))


def backward_floor(profiles: list[BlockProfile], memory: StaticMemory, block_gradients: list[int]) -> int:
    """The least budget of any plan: max(end of the backward, the walk at block 0 under its cheapest option).

    Why this and no more: both terms are points of peak_model that no other block's choice moves. The end
    (every gradient) is the same for every plan. The walk at block 0 (backward_walk's marks[0]) holds the
    gradients made before it (the head's and final norm's, every later block's; not the embedding's, made
    after every block, nor the part of block 0's own not yet made at its high mark, 1 - grad_share), and of
    the saved activations only block 0's (every later block freed its own): it depends on block 0's option
    alone. So every plan's peak is at least their max, which is no higher than the old floor (the end + block
    0's bytes, which counted the embedding's and block 0's late gradients beside block 0's high mark). The
    walk's other points and the forward depend on several blocks' options: the knapsack decides them."""
    end = memory.end_of_backward_bytes
    if not profiles:
        return end
    transient = block_transient(profiles)
    grads, early = _walk_gradients(memory, block_gradients)
    made = early + sum(grads[1:])
    first = [choose(profiles[0], name, ops, transient) for name, ops in OPTIONS.items()]
    return max(end, min(_backward_mark(c, made, c.saved_bytes, grads[0], memory, transient) for c in first))


def peak_plan(profiles: list[BlockProfile], budget_bytes: int, memory: StaticMemory,
              block_gradients: list[int]) -> tuple[list[BlockChoice], PeakModel]:
    """The least recomputation whose peak model fits `budget_bytes`, and that model."""
    floor = backward_floor(profiles, memory, block_gradients)
    if budget_bytes < floor:
        m = memory
        raise ValueError(
            f"activation_checkpoint.memory_budget_gib={budget_bytes / GIB:.4f} does not hold the weights, gradients "
            f"and AdamW moments the backward ends with, {m.end_of_backward_bytes} bytes "
            f"({m.end_of_backward_bytes / GIB:.4f} GiB per rank, gradients {m.gradient_bytes / GIB:.4f}), or those "
            f"at the first block's backward with its recomputation: {floor} "
            f"bytes ({floor / GIB:.4f} GiB); raise the budget to at least that")
    transient = block_transient(profiles)
    persist = memory.gradients_persist
    outside = memory.gradient_bytes - sum(block_gradients)
    early = memory.early_gradients(outside)
    own = [0] * len(profiles) if persist else list(block_gradients)
    later = [sum(own[i + 1:]) for i in range(len(profiles))]  # made before block i's backward
    caps = [budget_bytes - memory.forward_bytes - early - g for g in later]
    forward = budget_bytes - memory.forward_bytes - memory.forward_reserve(transient, outside)
    total = min(caps[-1] - own[-1], forward) if caps else forward
    keep_all = [choose(b, "keep", None, transient) for b in profiles]
    model = peak_model(keep_all, block_gradients, memory, transient)
    if model.total_bytes <= budget_bytes:  # nothing to recompute: the knapsack's rounded grid could miss it
        return keep_all, model
    choices = budget_plan(profiles, total, caps, budget_bytes - memory.forward_bytes, transient, own)
    choices = _less_recompute(profiles, choices, budget_bytes, memory, block_gradients)
    model = peak_model(choices, block_gradients, memory, transient)
    assert model.total_bytes <= budget_bytes, (model, budget_bytes)  # the caps are the model's constraints
    return choices, model


def planned_under_budget(profiles: list[BlockProfile], budget_bytes: int, memory: StaticMemory,
                         block_gradients: list[int]) -> tuple[list[BlockChoice], PeakModel]:
    """peak_plan aiming PLAN_HEADROOM under `budget_bytes` where a plan fits there, else at the budget itself
    (a budget within the headroom of the floor); its errors are the budget's."""
    try:
        return peak_plan(profiles, budget_bytes - int(budget_bytes * PLAN_HEADROOM), memory, block_gradients)
    except ValueError:
        return peak_plan(profiles, budget_bytes, memory, block_gradients)


def _less_recompute(profiles: list[BlockProfile], choices: list[BlockChoice], budget_bytes: int,
                    memory: StaticMemory, block_gradients: list[int]) -> list[BlockChoice]:
    """The knapsack's choices, each block moved to the option recomputing least whose exact peak model still
    fits: the knapsack rounds every block's bytes up to its grid, so near a level it may recompute a block
    that the budget holds kept (up to one grid step a block, ~0.025% of the budget each)."""
    transient = block_transient(profiles)
    choices = list(choices)
    for i, b in enumerate(profiles):
        options = sorted((choose(b, name, ops, transient) for name, ops in OPTIONS.items()),
                         key=lambda c: (c.recomputed_flops, c.saved_bytes))
        for c in options:
            if c.recomputed_flops >= choices[i].recomputed_flops:
                break
            trial = choices[:i] + [c] + choices[i + 1:]
            if peak_model(trial, block_gradients, memory, transient).total_bytes <= budget_bytes:
                choices = trial
                break
    return choices
