"""What a kept block really holds for its backward: the tensors autograd saves during its forward.

Counted with torch.autograd.graph.saved_tensors_hooks on the planner's meta copy of the model, by storage
(a view or an alias of a saved tensor counts once, with its whole storage, which is what stays alive), leaving
out the parameters and buffers and the tensors every block is handed besides its input (RoPE's cos/sin):
those live outside the blocks. Two things would make a meta forward save what the GPU run does not:
  attention  on meta scaled_dot_product_attention takes its math path, which saves the [b, h, s, s]
             probabilities; a fused kernel (flash, cuDNN, efficient) saves q, k, v, its output and the
             log-sum-exp, so the profile routes it through an opaque op (fused_attention) saving just those;
  compile    a compiled block's partitioner saves fewer tensors than eager (norms keep their bf16 input and
             rstd, not an fp32 copy, and pointwise chains are recomputed), so with compile.mode=blocks each
             block is compiled on meta with AOTAutograd's min-cut partitioner and inductor's decompositions
             (the aot_eager_decomp_partition backend: no code generated) and the compiled forward's
             save_for_backward is what the hooks see.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

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


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_block_bytes(model: nn.Module, forward: Callable[[], object], *, compiled: bool) -> list[int]:
    """Per block of model.layers, the bytes of the storages autograd saves in its forward (first saver counts),
    running `forward()` (model's forward over a microbatch) with gradients on; compiled: as compiled blocks."""
    outside = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, kept alive so no key is reused
    totals: list[int] = []
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if inside[0] and key not in outside and key not in seen:
            seen[key] = t
            totals[-1] += t.untyped_storage().nbytes()
        return t

    def enter(module, args, kwargs):
        shared = [t for t in tree_flatten((args[1:], kwargs))[0] if isinstance(t, torch.Tensor)]
        outside.update(_storage_key(t) for t in shared)  # handed to every block: not one block's
        totals.append(0)
        inside[0] = True

    def leave(*_):
        inside[0] = False

    blocks = {name: torch.compile(block, backend=COMPILED_BACKEND) if compiled else block
              for name, block in model.layers.items()}
    originals = dict(model.layers.items())
    handles = [b.register_forward_pre_hook(enter, with_kwargs=True) for b in blocks.values()]
    handles += [b.register_forward_hook(leave) for b in blocks.values()]
    try:
        for name, block in blocks.items():
            model.layers[name] = block
        with torch.enable_grad(), fused_attention_profile(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            forward()
    finally:
        for handle in handles:
            handle.remove()
        for name, block in originals.items():
            model.layers[name] = block
    return totals


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
