"""Device dispatch: Triton kernels on CUDA (when Triton imports), the torch versions elsewhere."""
from __future__ import annotations

import functools

import torch

from titan_rl.batch_invariant import torch_ops


@functools.cache
def _triton_ops():
    try:
        from titan_rl.batch_invariant import triton_ops
    except ImportError:  # no triton: the torch versions are batch-invariant too, only slower on GPU
        return None
    return triton_ops


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_ops() is not None


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _triton_ops().matmul(x, weight) if _use_triton(x) else torch_ops.matmul(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _triton_ops().rms_norm(x, weight, eps) if _use_triton(x) else torch_ops.rms_norm(x, weight, eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _triton_ops().log_softmax(x) if _use_triton(x) else torch_ops.log_softmax(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    # exp/add/div are bitwise-stable on GPU too (elementwise, no reductions)
    return torch_ops.silu(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor, scale: float,
              kv_len: torch.Tensor | None = None, window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    if _use_triton(q):
        return _triton_ops().attention(q, k, v, q_positions=q_positions, scale=scale, kv_len=kv_len, window=window,
                                       sinks=sinks)
    return torch_ops.attention(q, k, v, q_positions=q_positions, scale=scale, kv_len=kv_len, window=window,
                               sinks=sinks)
