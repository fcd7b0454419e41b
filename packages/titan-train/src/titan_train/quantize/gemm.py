"""The scaled GEMM of two quantised operands, both with the reduction dimension last: out = a . b^T.

backend "emulated" (CPU, or asked for): dequantise both (exact: the scales are powers of two) and multiply
in fp32, so the result is the fp8 GEMM's up to the order of the fp32 accumulation. "auto" on CUDA:
  scaled_mm  torch._scaled_mm (cuBLAS fp8): one scale per tensor, or per row of a and per row of b;
  blockwise  the Triton GEMM of blockwise_triton.py (per 1x128 / 128x128 block scales, fp32 accumulation
             promoted every 128 reduction elements, as DeepSeek-V3 does against the tensor cores' narrower
             accumulator);
  mx         mx_triton.py's tl.dot_scaled on GPUs with MX tensor cores (sm_100+); elsewhere (Hopper) the
             dequantised operands in bf16 (exact, see scaling.py) through a bf16 GEMM: the recipe's
             numerics, not its speed.
"""
from __future__ import annotations

import torch

from .scaling import QuantizedMatrix


def scaled_matmul(a: QuantizedMatrix, b: QuantizedMatrix, *, kernel: str, out_dtype: torch.dtype,
                  backend: str = "auto") -> torch.Tensor:
    """a [M, K] . b [N, K]^T -> [M, N] in out_dtype, accumulated in fp32."""
    assert a.cols == b.cols and a.data.shape[1] == b.data.shape[1], (a.data.shape, b.data.shape)
    if backend == "emulated" or not a.data.is_cuda:
        return emulated_matmul(a, b, out_dtype=out_dtype)
    if kernel == "scaled_mm":
        return _scaled_mm(a, b, out_dtype=out_dtype)
    if kernel == "blockwise":
        from .blockwise_triton import blockwise_gemm

        return blockwise_gemm(a.data, b.data, a.scale, b.scale, b_scale_rows=b.blocking.rows, out_dtype=out_dtype)
    if kernel == "mx":
        from .mx_triton import mx_native_supported, mx_scaled_gemm

        if mx_native_supported(a.data.device):
            return mx_scaled_gemm(a, b, out_dtype=out_dtype)
        return _in_dtype(a.dequantize(torch.bfloat16) @ b.dequantize(torch.bfloat16).t(), out_dtype)
    raise AssertionError(f"unknown kernel {kernel!r}")


def emulated_matmul(a: QuantizedMatrix, b: QuantizedMatrix, *, out_dtype: torch.dtype) -> torch.Tensor:
    return _in_dtype(a.dequantize(torch.float32) @ b.dequantize(torch.float32).t(), out_dtype)


def _scaled_mm(a: QuantizedMatrix, b: QuantizedMatrix, *, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm(mat1 row-major [M, K], mat2 column-major [K, N], scale_a, scale_b): tensorwise scales
    are [1, 1] each, rowwise ones scale_a [M, 1] and scale_b [1, N] (fp32, contiguous; bf16 output)."""
    scale_b = b.scale.reshape(1, -1) if b.scale.numel() > 1 else b.scale
    out = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=scale_b,
                           out_dtype=out_dtype if a.scale.numel() == 1 else torch.bfloat16)
    return _in_dtype(out, out_dtype)


def _in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`out` in `dtype`, with no `.to` when it already is: torch 2.11's dynamo turns the gradients of an
    autograd.Function to zeros when its forward returns a same-dtype `.to` (an alias of the product), so a
    compiled block learned only through its unconverted modules (2.14 is fixed; test_quantize_training.py's
    compiled test catches it on 2.11)."""
    return out if out.dtype == dtype else out.to(dtype)
