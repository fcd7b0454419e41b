"""SwiGLU over the fused gate/up projection, with a one-pass Triton backward on CUDA.

    h = silu(gate) * up,   gate_up [..., 2F] = [gate | up] (the output of one GEMM over [w1; w3])

Backward, per element (s = sigmoid(gate)):
    dup   = dh * gate * s
    dgate = dh * up * s * (1 + gate * (1 - s))
written side by side as d gate_up [..., 2F], the layout the GEMMs of the fused projection consume.
The forward stays in torch ops, so torch.compile fuses it with its neighbours (on meta it allocates as on a GPU).
On meta tensors (the remat planner's profile, remat/held.py) the backward is one opaque op allocating what
the kernel does, its output, no fp32 intermediates, so the profile prices what the GPU holds: the torch
reference's fp32 temporaries peak 14 bytes a gate_up element above the kernel's (3.06 GiB a block of the 8B
at 2 x 4096 tokens).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_models.components.ffn import FeedForward
from titan_models.components.ffn import swiglu as plain_swiglu
from titan_models.components.projections import project_fused

_BLOCK_ROWS, _BLOCK_COLS, _WARPS = 4, 1024, 8


def swiglu_backward_reference(gate_up: Tensor, grad_h: Tensor) -> Tensor:
    """The backward in torch ops (CPU, and the check of the kernel): d gate_up in gate_up's dtype, computed in
    at least fp32."""
    acc = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    dh = grad_h.to(acc)
    s = torch.sigmoid(gate)
    return torch.cat([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], dim=-1).to(gate_up.dtype)


def _swiglu_backward_triton(gate_up: Tensor, grad_h: Tensor) -> Tensor:
    import triton

    from titan_train.kernels.swiglu_triton import swiglu_backward_kernel

    width = grad_h.shape[-1]
    gu = gate_up.reshape(-1, 2 * width)
    dh = grad_h.reshape(-1, width)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    if dh.stride(-1) != 1:
        dh = dh.contiguous()
    out = torch.empty(gu.shape, dtype=gate_up.dtype, device=gate_up.device)
    rows = gu.shape[0]
    grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(width, _BLOCK_COLS))
    swiglu_backward_kernel[grid](gu, dh, out, rows, width, gu.stride(0), dh.stride(0), out.stride(0),
                                 BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=_WARPS)
    return out.view(gate_up.shape)


@torch.library.custom_op("titan_train::swiglu_backward_profile", mutates_args=())
def swiglu_backward_profile(gate_up: Tensor, grad_h: Tensor) -> Tensor:
    """The kernel as the remat planner's meta profile sees it: one op taking gate_up and the gradient (so a
    compiled block's partitioner saves gate_up, as for the kernel's launch on a GPU) and making d gate_up in
    gate_up's dtype, nothing else; defined for meta tensors only."""
    raise NotImplementedError("titan_train::swiglu_backward_profile only profiles meta tensors")


@swiglu_backward_profile.register_fake
def _(gate_up, grad_h):
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


def swiglu_backward(gate_up: Tensor, grad_h: Tensor, *, use_triton: bool | None = None) -> Tensor:
    """d gate_up for h = silu(gate) * up; use_triton=None: the Triton kernel on CUDA tensors, its allocations
    alone on meta ones (values undefined: meta has none), the torch reference elsewhere; or as told. By
    device.type: a fake tensor standing in for a CUDA one (torch.compile's tracing) is a CUDA tensor here."""
    if use_triton is None:
        if gate_up.device.type == "meta":
            return swiglu_backward_profile(gate_up, grad_h)
        use_triton = gate_up.device.type == "cuda"
    return _swiglu_backward_triton(gate_up, grad_h) if use_triton else swiglu_backward_reference(gate_up, grad_h)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_h: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        return swiglu_backward(gate_up, grad_h)


def swiglu(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2F] -> silu(gate) * up [..., F], with the one-pass backward."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension ([gate | up]), got {tuple(gate_up.shape)}")
    return _SwiGLU.apply(gate_up)


class FusedSwiGLUFeedForward(FeedForward):
    """titan-models' FeedForward (same parameters) whose activation runs through `swiglu` when the gate and
    up projections are one GEMM; otherwise (sharded or replaced projections) exactly FeedForward."""

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project_fused(x, self.w1, self.w3)
        if gate_up is None:
            return super().forward(x)
        return self.w2(swiglu(gate_up))


def use_fused_swiglu(model: nn.Module) -> list[str]:
    """Give every titan-models FeedForward of `model` whose activation is the plain SwiGLU the fused one (in
    place); returns their names. Others (a clamped SwiGLU: DeepSeek-V4's shared expert) keep their own."""
    import titan_models as tm

    names = [name for name, module in model.named_modules()
             if type(module) is FeedForward and module.activation is plain_swiglu]
    for name in names:
        tm.override(model, name, _as_fused)
    return names


def _as_fused(name: str, old: FeedForward) -> FusedSwiGLUFeedForward:
    new = FusedSwiGLUFeedForward.__new__(FusedSwiGLUFeedForward)
    new.__dict__ = dict(old.__dict__)  # the same submodules and parameters: no tensor is copied
    return new
