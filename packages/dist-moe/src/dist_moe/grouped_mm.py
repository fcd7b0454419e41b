"""grouped_mm(x [T, K], w [E, K, N], offsets [E]) -> [T, N]: rows of expert e times w[e], with autograd.

Rows are sorted by expert; `offsets` [E] int32 holds each group's end row (cumulative), so group
e is rows offsets[e-1]:offsets[e] (offsets[-1] must be T). Empty groups are allowed. On CUDA the
Triton kernels run without reading the offsets on the host; the torch path (CPU) loops over
experts and reads them once per call.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_moe.backend import Backend, resolve_backend
from dist_moe.host_sync import read_to_host


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, *, backend: Backend = "auto") -> Tensor:
    """out[rows of e] = x[rows of e] @ w[e]; differentiable in x and w. See the module docstring."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"x must be [T, K] and w [E, K, N]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} columns but w[e] has {w.shape[1]} rows")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0]:
        raise ValueError(f"offsets must be [E={w.shape[0]}], got {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
    if x.dtype != w.dtype or not x.is_floating_point():
        raise TypeError(f"x and w must share one floating dtype; got {x.dtype} and {w.dtype}")
    if x.device != w.device or x.device != offsets.device:
        raise ValueError(f"x, w and offsets must be on one device; got {x.device}, {w.device}, {offsets.device}")
    resolved = resolve_backend(backend, x)
    return _GroupedMM.apply(x, w, offsets.to(torch.int32), resolved)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor, backend: str) -> Tensor:
        ctx.backend = backend
        ctx.save_for_backward(x, w, offsets)
        if backend == "torch":
            ends = _host_ends(offsets, x.shape[0])
            ctx.ends = ends
            return loop_mm(x, w, ends)
        return _triton_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, w, offsets = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype).contiguous()  # one operand dtype for the kernels (the forward's)
        dx = dw = None
        if ctx.backend == "torch":
            if ctx.needs_input_grad[0]:
                dx = loop_mm(grad_out, w.transpose(1, 2), ctx.ends)
            if ctx.needs_input_grad[1]:
                dw = loop_weight_grad(x, grad_out, ctx.ends, like=w)
            return dx, dw, None, None
        if ctx.needs_input_grad[0]:
            dx = _triton_mm(grad_out, w.transpose(1, 2), offsets)
        if ctx.needs_input_grad[1]:
            from dist_moe.kernels.launch import weight_gemm

            dw = torch.empty_like(w)  # keeps w's layout (a transposed Linear weight stays transposed)
            # dw[e] = x_e^T dy_e; computed as its transpose dy_e^T x_e when K is dw's contiguous
            # axis, so the kernel's stores run along rows.
            if dw.stride(1) == 1 and dw.stride(2) != 1:
                weight_gemm(p=grad_out, q=x, ends=offsets, outs=(dw.transpose(1, 2),))
            else:
                weight_gemm(p=x, q=grad_out, ends=offsets, outs=(dw,))
        return dx, dw, None, None


def _triton_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    from dist_moe.kernels.launch import RowOperands, row_gemm

    out = x.new_empty(x.shape[0], w.shape[2])
    row_gemm(RowOperands(a=x, b=w, offsets=offsets, out=out, num_rows=x.shape[0]))
    return out


def _host_ends(offsets: Tensor, rows: int) -> list[int]:
    ends = read_to_host(offsets, "grouped_mm: per-expert row ends (torch path)")
    if any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] != rows):
        raise ValueError(f"offsets must be non-decreasing and end at T={rows}; got {ends}")
    return ends


def loop_mm(x: Tensor, w: Tensor, ends: list[int]) -> Tensor:
    """The torch path: one matmul per non-empty expert."""
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def loop_weight_grad(x: Tensor, grad_out: Tensor, ends: list[int], *, like: Tensor) -> Tensor:
    dw = torch.zeros_like(like)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            dw[e] = x[start:end].T @ grad_out[start:end]
        start = end
    return dw
