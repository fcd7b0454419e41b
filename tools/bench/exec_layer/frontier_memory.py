"""Counted peak memory of one titan-train step under each activation checkpointing mode: what remat_frontier.py
prints as 'pred GiB' and uses to skip points that cannot fit.

The counting is tools/bench/train_throughput/memory_model.py's (its activation layouts of the compiled
block, measured there through saved-tensor hooks), extended to the checkpointing modes:
  state     bytes a parameter holds through the forward: the weights, fp32 master (bf16_params) and the two
            AdamW moments; the gradients (zero_grad sets them to None) come only in the backward;
  forward   the peak at the end of the forward: state + saved activations + the fused loss's chunk of
            logits and output-weight gradient sum + embedding output, fp32 final-norm input and token rows;
  backward  state + gradients + one block's recomputed (or not yet freed) values, the backward's high mark
            when little is saved (full checkpointing);
  remat     activation_checkpoint.memory_budget_gib is a TOTAL: the planner (titan_train/remat/peak.py) keeps
            the saved activations it plans (in its profile's bytes) under budget - state - its reserve at the
            backward's start (the largest of the last block's backward transient, kept, with the head's and its
            gradients, its count of the loss buffers at the last chunk, and those less the chunk with the
            head's gradients; the embedding's gradient comes after the blocks', and the gradients are None
            through the forward), so its peak is counted as state + that much + loss + other, no
            less than full checkpointing's and no more than none's; it refuses budgets below its floor: the
            larger of state + all the gradients (the backward's end) and its backward at the first block under
            that block's cheapest option (state + every gradient but the embedding's and the first block's own,
            + that block's saved bytes, backward transient and the share of its gradients made by then).
The allocator's slack (~1 GiB measured on the 1.5B model) is not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A Llama's sizes (titan_models' Llama3Config fields) and how the run holds them."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    value_bytes: int = 2
    """Bytes an activation (2: bf16_params; 4: fp32, the CPU check)."""
    forward_state_bytes: int = 10
    """Per parameter through the forward: bf16 weight 2 + fp32 master 4 + bf16 moments 2 x 2."""
    grad_bytes: int = 2
    loss_chunk: int = 2048
    """training.loss_chunk_size"""
    loss_weight_grad_bytes: int = 2
    """training.loss_weight_grad_dtype: param (bf16) 2, float32 4."""
    loss_logit_bytes: int = 2
    """The remat planner's bytes a logit of the loss's chunk: 2 for the Triton kernel (bf16 logits, the gradient
    written over them), 8 for the torch paths (the CPU check)."""
    planner_keep_bytes_per_token: int = 0
    planner_keep_fixed_bytes: int = 0
    """A block's keep bytes as the remat planner's profile counts them (what a compiled block saves for its
    backward): fixed + per token (remat_frontier.model_setup measures both with titan_train.remat.profile_blocks)."""

    planner_keep_transient_bytes_per_token: int = 0
    planner_keep_transient_fixed_bytes: int = 0
    """A kept block's backward transient as the planner measures it (held.py: its backward's high mark less
    what it saved)."""
    planner_floor_block_bytes_per_token: int = 0
    planner_floor_block_fixed_bytes: int = 0
    """The first block's least backward high mark over the options, its gradients made by then included: what
    the planner's walk at that block adds to the state and the gradients made before it."""

    def planner_keep_bytes(self, tokens: int) -> int:
        return self.planner_keep_fixed_bytes + tokens * self.planner_keep_bytes_per_token

    def planner_keep_transient_bytes(self, tokens: int) -> int:
        return self.planner_keep_transient_fixed_bytes + tokens * self.planner_keep_transient_bytes_per_token

    @property
    def kv(self) -> int:
        return self.dim // self.heads * self.kv_heads

    @property
    def parameters(self) -> int:
        return self.layers * self.block_parameters + 2 * self.vocab * self.dim + self.dim

    @property
    def planner_static_bytes(self) -> int:
        """Weights, gradients and moments (state_bytes_per_param: 12 a parameter under bf16_params with bf16
        moments, 16 in fp32): what the remat planner's step holds at the end of the backward."""
        return self.parameters * (self.forward_state_bytes + self.grad_bytes)

    @property
    def block_parameters(self) -> int:
        d = self.dim
        return d * (2 * d + 2 * self.kv) + 3 * d * self.ffn + 2 * d

    def planner_floor_bytes(self, tokens: int) -> int:
        """The least budget the planner accepts (remat/peak.py backward_floor): the larger of the end of the
        backward and its walk at the first block (the state, every gradient but the embedding's and the first
        block's, + that block's high mark under its cheapest option)."""
        made = (self.parameters - self.vocab * self.dim - self.block_parameters) * self.grad_bytes
        first = (self.parameters * self.forward_state_bytes + made + self.planner_floor_block_fixed_bytes
                 + tokens * self.planner_floor_block_bytes_per_token)
        return max(self.planner_static_bytes, first)

    def planner_reserve_bytes(self, tokens: int) -> int:
        """What the planner holds back from budget - forward state for the backward's start (peak.py peak_plan,
        memory_estimate.remat_static_memory's loss buffers, no autocast): the gradients outside the blocks but
        the (untied) embedding's, made last, and the loss's buffers, its chunk's logits freed before them."""
        early = (self.parameters - self.layers * self.block_parameters - self.vocab * self.dim) * self.grad_bytes
        chunk = min(self.loss_chunk, tokens) * self.vocab * self.loss_logit_bytes
        loss = chunk + self.vocab * self.dim * self.loss_weight_grad_bytes + tokens * self.dim * (2 * self.value_bytes + 8)
        transient = self.planner_keep_transient_bytes(tokens)  # the last block's, kept
        return max(transient + early + self.block_parameters * self.grad_bytes, loss, loss - chunk + early)


def _per_token_layer(shape: Shape, saved: str) -> int:
    """Bytes a token keeps per layer (memory_model.values_per_token_layer's layouts)."""
    d, kv, ffn = shape.dim, shape.kv, shape.ffn
    values = {"none": 7 * d + 3 * kv + 3 * ffn, "ops": 4 * d + 2 * kv + 2 * ffn, "full": d}[saved]
    return values * shape.value_bytes


def _weight_cats(shape: Shape) -> int:
    """A non-checkpointed compiled block keeps its fused q/k/v and gate/up weight concatenations."""
    d = shape.dim
    return d * (2 * shape.ffn + d + 2 * shape.kv) * shape.value_bytes


def _loss_and_other(shape: Shape, tokens: int) -> int:
    loss = shape.value_bytes * min(shape.loss_chunk, tokens) * shape.vocab
    loss += shape.loss_weight_grad_bytes * shape.vocab * shape.dim
    return loss + tokens * shape.dim * (2 * shape.value_bytes + 4) + 3 * tokens * 8


def activations(shape: Shape, tokens: int, mode: str, every: int = 2) -> int:
    """Saved bytes at the end of the forward under `mode` (full, ops, layers, none)."""
    none = tokens * _per_token_layer(shape, "none") + _weight_cats(shape)
    if mode == "none":
        return shape.layers * none
    if mode == "ops":
        return shape.layers * tokens * _per_token_layer(shape, "ops")
    checkpointed = shape.layers if mode == "full" else math.ceil(shape.layers / every)
    assert mode in ("full", "layers"), mode
    return checkpointed * tokens * _per_token_layer(shape, "full") + (shape.layers - checkpointed) * none


def peak(shape: Shape, tokens: int, mode: str, every: int = 2) -> int:
    """Counted peak bytes of an existing mode: the larger of the forward's and the backward's high mark."""
    state = shape.parameters * shape.forward_state_bytes
    forward = state + activations(shape, tokens, mode, every) + _loss_and_other(shape, tokens)
    one_block = tokens * _per_token_layer(shape, "none") + _weight_cats(shape)
    backward = state + shape.parameters * shape.grad_bytes + one_block
    return max(forward, backward)


def remat_peak(shape: Shape, tokens: int, budget_bytes: int) -> int:
    """Counted peak of activation_checkpoint.mode=remat at a total budget (see the module docstring)."""
    state = shape.parameters * shape.forward_state_bytes
    planned = max(budget_bytes - state - shape.planner_reserve_bytes(tokens), 0)
    counted = state + planned + _loss_and_other(shape, tokens)
    return max(peak(shape, tokens, "full"), min(peak(shape, tokens, "none"), counted))
