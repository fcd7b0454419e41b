"""q and k's L2 normalisation for the Triton delta rule (`triton_chunked_delta_rule(..., qk_l2norm=True)`):
one launch normalises both (q also scaled by dk^-1/2), one launch gives both input gradients.

flash-linear-attention's definition, as `components.gated_deltanet.l2_normalize`: y = x / sqrt(sum(x^2) +
eps) over the head dim, in float32, here stored in the kernels' operand dtype. The layer's torch form of
it (cast, square, sum, add, rsqrt, multiply, scale, cast back: 13 elementwise kernels over float32 copies
of q and k, ~1.2 GB at 4096 tokens, 32 heads of 128: by bytes over a third of the bf16 forward's 0.77 ms
on the H200) ran outside the kernels; fla runs its own as one kernel per tensor. Gradient (r = rsqrt(sum(x^2) + eps), y = x r, output s y): dx = s r (dy - y (y . dy)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-6  # l2_normalize's
ROWS = 32  # rows per program: 4096 elements at dk 128


@triton.jit
def _normalise_rows(x_ptr, y_ptr, rows, scale, eps, D: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    offsets = r[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
    mask = r[:, None] < rows
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None] * scale  # (x r) s, as l2_normalize(x) * s
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def l2_norm_kernel(q_ptr, k_ptr, qn_ptr, kn_ptr, rows, q_scale, eps, D: tl.constexpr, BR: tl.constexpr):
    """Grid (row blocks, 2): axis 1 picks q (scaled) or k."""
    if tl.program_id(1) == 0:
        _normalise_rows(q_ptr, qn_ptr, rows, q_scale, eps, D, BR)
    else:
        _normalise_rows(k_ptr, kn_ptr, rows, 1.0, eps, D, BR)


@triton.jit
def _normalise_rows_backward(x_ptr, dy_ptr, dx_ptr, rows, scale, eps, D: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    offsets = r[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
    mask = r[:, None] < rows
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]
    y = x * rstd
    dx = scale * rstd * (dy - y * tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def l2_norm_backward_kernel(q_ptr, k_ptr, dqn_ptr, dkn_ptr, dq_ptr, dk_ptr, rows, q_scale, eps,
                            D: tl.constexpr, BR: tl.constexpr):
    if tl.program_id(1) == 0:
        _normalise_rows_backward(q_ptr, dqn_ptr, dq_ptr, rows, q_scale, eps, D, BR)
    else:
        _normalise_rows_backward(k_ptr, dkn_ptr, dk_ptr, rows, 1.0, eps, D, BR)


def _check(q: torch.Tensor, k: torch.Tensor) -> int:
    if q.shape != k.shape or not (q.is_contiguous() and k.is_contiguous()):
        raise ValueError(f"q and k must be contiguous and of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    return q.numel() // q.shape[-1]


def l2_norm_qk(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(l2_normalize(q) * dk^-1/2, l2_normalize(k)) in `dtype`; q, k [..., dk] contiguous, one shape."""
    rows, dk = _check(q, k), q.shape[-1]
    qn, kn = torch.empty(q.shape, device=q.device, dtype=dtype), torch.empty(k.shape, device=k.device, dtype=dtype)
    l2_norm_kernel[(triton.cdiv(rows, ROWS), 2)](q, k, qn, kn, rows, dk**-0.5, EPS, D=dk, BR=ROWS, num_warps=4)
    return qn, kn


def l2_norm_qk_backward(q: torch.Tensor, k: torch.Tensor, dqn: torch.Tensor, dkn: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (float32) of q and k through `l2_norm_qk` from those of its outputs (contiguous)."""
    rows, dk = _check(q, k), q.shape[-1]
    dq, dk_ = (torch.empty(q.shape, device=q.device, dtype=torch.float32) for _ in range(2))
    l2_norm_backward_kernel[(triton.cdiv(rows, ROWS), 2)](q, k, dqn.contiguous(), dkn.contiguous(), dq, dk_, rows,
                                                          dk**-0.5, EPS, D=dk, BR=ROWS, num_warps=4)
    return dq, dk_
