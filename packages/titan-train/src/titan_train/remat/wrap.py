"""A block under one remat option, as the trainer runs it and as the planner prices it (the same wrapper).

The policy reaches torch.compile as partial(_save_policy, save_ops), not as a closure: dynamo guards a
checkpoint's context_fn by its function and partial arguments (guard_as_python_constant), never by a
closure's cells, so blocks whose closures differed only in save_ops shared the first compiled block's graph:
in a compiled mixed plan every selectively checkpointed block saved what the first one did (issue 20: 10
save_attention blocks saving matmuls too, +5.6 GiB on the 8B). With save_ops a partial argument the guard
compares the tuple and each policy compiles its own graph (test_remat_options.py counts it).

A block checkpointed whole is a selective checkpoint whose policy recomputes every op, not torch's plain
checkpoint: compiled on torch 2.11, the plain one left the ops of a custom autograd.Function (the fused
SwiGLU's, kernels/swiglu.py) without the checkpoint's recompute tag, and the partitioner saved their output
(pytorch/pytorch#177396, fixed later by the same route): an 8B block saved its [tokens, 14336] SwiGLU output
beside its [tokens, 4096] input, 4.3x the bytes, measured on the H200. The selective path tags every op it
dispatches, the Function's too (test_remat_whole.py).
"""
from __future__ import annotations

from functools import partial

import torch.nn as nn

from .ops import ATTENTION_OPS, op_name


def _save_policy(save_ops: tuple[str, ...], ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = op_name(op)
    if name in save_ops or ("flex_attention" in name and "flex_attention" in save_ops):
        return CheckpointPolicy.MUST_SAVE
    # the planner's meta stand-in for a fused attention kernel (saved.py) is saved where any attention op is
    if name == "fused_attention" and any(a in save_ops for a in ATTENTION_OPS):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_policy(save_ops: tuple[str, ...]):
    """The selective-checkpoint policy saving the outputs of `save_ops` (aten op names) and recomputing the rest."""
    return partial(_save_policy, tuple(save_ops))


def wrap_block(block: nn.Module, save_ops: tuple[str, ...] | None) -> nn.Module:
    """None: the block itself (kept); (): checkpointed whole (every op recomputed); else selectively, saving
    `save_ops`' outputs."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if save_ops is None:
        return block
    context = partial(create_selective_checkpoint_contexts, save_policy(save_ops))
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context)


def checkpoint_whole(block: nn.Module) -> nn.Module:
    """`block` checkpointed whole: only its input saved, every op recomputed in the backward."""
    return wrap_block(block, ())
