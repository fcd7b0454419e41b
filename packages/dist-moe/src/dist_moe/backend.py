"""Which implementation runs: the Triton kernels on CUDA, torch elsewhere."""
from __future__ import annotations

import importlib.util
from typing import Literal

from torch import Tensor

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


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
