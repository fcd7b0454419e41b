"""Which implementation runs: the Triton kernels on CUDA, torch elsewhere."""
from __future__ import annotations

import importlib.util
from typing import Literal

from torch import Tensor

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
# Who computes the expert weight gradients on the Triton path: dist-moe's kernel, or (a measured
# fallback, see tools/bench/moe) torch._grouped_mm on the same padded operands.
WeightGrad = Literal["triton", "torch_grouped_mm"]
WEIGHT_GRADS: tuple[str, ...] = ("triton", "torch_grouped_mm")


def check_weight_grad(weight_grad: str) -> None:
    if weight_grad not in WEIGHT_GRADS:
        raise ValueError(f"weight_grad must be one of {WEIGHT_GRADS}, got {weight_grad!r}")
    if weight_grad == "torch_grouped_mm" and not hasattr(__import__("torch"), "_grouped_mm"):
        raise ValueError("weight_grad='torch_grouped_mm' needs torch._grouped_mm, which this torch lacks")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, tensor: Tensor) -> str:
    """'triton' or 'torch'. 'auto' picks Triton for CUDA tensors when triton is installed; asking
    for 'triton' on CPU tensors is allowed only under TRITON_INTERPRET=1 (the kernel tests)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package, which is not installed")
        from dist_moe.kernels.configs import interpreting

        if not tensor.is_cuda and not interpreting():
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    return backend
