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
  remat     activation_checkpoint.memory_budget_gib is a TOTAL: the planner (titan_train/remat) keeps the
            saved activations it plans under budget - (weights + gradients + moments) and leaves the loss
            buffers and the allocator out, so its peak is counted as state + that much + loss + other,
            no less than full checkpointing's and no more than none's.
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

    @property
    def kv(self) -> int:
        return self.dim // self.heads * self.kv_heads

    @property
    def parameters(self) -> int:
        d = self.dim
        return self.layers * (d * (2 * d + 2 * self.kv) + 3 * d * self.ffn + 2 * d) + 2 * self.vocab * d + d

    @property
    def planner_static_bytes(self) -> int:
        """What titan-train's remat planner counts against the budget: weights, gradients and moments
        (state_bytes_per_param: 12 a parameter under bf16_params with bf16 moments, 16 in fp32)."""
        return self.parameters * (self.forward_state_bytes + self.grad_bytes)


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
    planned = max(budget_bytes - shape.planner_static_bytes, 0)
    state = shape.parameters * shape.forward_state_bytes
    counted = state + planned + _loss_and_other(shape, tokens)
    return max(peak(shape, tokens, "full"), min(peak(shape, tokens, "none"), counted))

