"""What makes a meta profile of a block save what the GPU run does (held.py counts it, by storage: a view
or an alias of a saved tensor counts once, with its whole storage, which is what stays alive):
  attention  on meta scaled_dot_product_attention takes its math path, which saves the [b, h, s, s]
             probabilities; a fused kernel (flash, cuDNN, efficient) saves q, k, v, its output and the
             log-sum-exp, so the profile routes it through an opaque op (fused_attention) saving just those;
  compile    a compiled block's partitioner saves fewer tensors than eager (norms keep their bf16 input and
             rstd, not an fp32 copy, and pointwise chains are recomputed), so with compile.mode=blocks each
             block is compiled on meta with AOTAutograd's min-cut partitioner and inductor's decompositions
             (the aot_eager_decomp_partition backend: no code generated) and the compiled forward's
             save_for_backward is what saved-tensor hooks see.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

COMPILED_BACKEND = "aot_eager_decomp_partition"  # inductor's partitioning and decompositions, no codegen


@torch.library.custom_op("titan_remat::fused_attention", mutates_args=())
def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of a fused attention kernel; defined for meta profiles only."""
    raise NotImplementedError("titan_remat::fused_attention only profiles meta tensors")


@fused_attention.register_fake
def _(q, k, v):
    # laid out [b, s, heads, dim] as the flash kernels write it, so the heads' merge after it is a view, not a copy
    b, h, s = q.shape[:3]
    return q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("titan_remat::fused_attention_backward", mutates_args=())
def fused_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Opaque like the flash backward, so a compiled block's partitioner saves every input it takes."""
    raise NotImplementedError("titan_remat::fused_attention_backward only profiles meta tensors")


@fused_attention_backward.register_fake
def _(grad, q, k, v, out, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)  # what the flash kernels keep: q, k, v, output, log-sum-exp


def _backward(ctx, grad_out, grad_lse):
    return fused_attention_backward(grad_out, *ctx.saved_tensors)


fused_attention.register_autograd(_backward, setup_context=_setup)


def _profiled_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return fused_attention(query, key, value)[0]


@contextmanager
def fused_attention_profile() -> Iterator[None]:
    """scaled_dot_product_attention as fused_attention while profiling: the models call it through
    torch.nn.functional at run time, and dynamo inlines the replacement, so eager and compiled blocks see it."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _profiled_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
