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
Each GPU GEMM is one opaque custom op (titan_train::fp8_scaled_mm, ::mx_dequantized_mm,
::fp8_blockwise_gemm) taking the materialised fp8 operands and scales, so torch.compile runs the kernel
eager runs (the one test_gpu_gemms_match_float64 checks) instead of lowering it itself: traced as aten ops,
Inductor may put torch._scaled_mm on its own Triton templates (on sm_90 even without max-autotune) and fuse
MX's quantise -> dequantise into the producers of a bf16 GEMM. Compiled blocks on the H200 trained far slower
than bf16 with exactly the three recipes whose GEMMs it could see (the blockwise one, a custom op, tracked).
backend "kernels": the GPU path on any device (torch._scaled_mm and the MX bf16 path have CPU kernels too;
tests use it to check the traced graph on CPU).
"""
from __future__ import annotations

import torch

from .scaling import QuantizedMatrix


def scaled_matmul(a: QuantizedMatrix, b: QuantizedMatrix, *, kernel: str, out_dtype: torch.dtype,
                  backend: str = "auto", fast_accum: bool = False) -> torch.Tensor:
    """a [M, K] . b [N, K]^T -> [M, N] in out_dtype, accumulated in fp32 (fast_accum: scaled_mm's use_fast_accum,
    the tensor cores' own accumulator; the emulated path stays exact)."""
    assert a.cols == b.cols and a.data.shape[1] == b.data.shape[1], (a.data.shape, b.data.shape)
    if backend == "emulated" or (backend == "auto" and not a.data.is_cuda):
        return emulated_matmul(a, b, out_dtype=out_dtype)
    if kernel == "scaled_mm":
        return _scaled_mm_op(a.data, b.data, a.scale, b.scale, out_dtype, fast_accum)
    if kernel == "blockwise":
        from .blockwise_triton import blockwise_gemm

        return blockwise_gemm(a.data, b.data, a.scale, b.scale, b_scale_rows=b.blocking.rows, out_dtype=out_dtype)
    if kernel == "mx":
        from .mx_triton import mx_native_supported, mx_scaled_gemm

        if mx_native_supported(a.data.device):
            return mx_scaled_gemm(a, b, out_dtype=out_dtype)
        return _mx_dequantized_mm_op(a.data, a.scale, b.data, b.scale, out_dtype)
    raise AssertionError(f"unknown kernel {kernel!r}")


def emulated_matmul(a: QuantizedMatrix, b: QuantizedMatrix, *, out_dtype: torch.dtype) -> torch.Tensor:
    return _in_dtype(a.dequantize(torch.float32) @ b.dequantize(torch.float32).t(), out_dtype)


def _scaled_mm(a: QuantizedMatrix, b: QuantizedMatrix, *, out_dtype: torch.dtype, fast_accum: bool = False
               ) -> torch.Tensor:
    return _scaled_mm_op(a.data, b.data, a.scale, b.scale, out_dtype, fast_accum)


@torch.library.custom_op("titan_train::fp8_scaled_mm", mutates_args=())
def _scaled_mm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a [M, K] . b [N, K]^T by torch._scaled_mm(mat1 row-major [M, K], mat2 column-major [K, N], scale_a,
    scale_b): tensorwise scales are [1, 1] each, rowwise ones scale_a [M, 1] and scale_b [1, N] (fp32,
    contiguous; bf16 output)."""
    a, b = a.contiguous(), b.contiguous()
    scale_b = scale_b.reshape(1, -1) if scale_b.numel() > 1 else scale_b
    out = torch._scaled_mm(a, b.t(), scale_a=scale_a.contiguous(), scale_b=scale_b.contiguous(),
                           out_dtype=out_dtype if scale_a.numel() == 1 else torch.bfloat16, use_fast_accum=fast_accum)
    return _in_dtype(out, out_dtype)


@_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, out_dtype, fast_accum):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("titan_train::mx_dequantized_mm", mutates_args=())
def _mx_dequantized_mm_op(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, Kp] . b [N, Kp]^T of 1 x block MX operands (scales [rows, Kp / block]), dequantised to bf16
    (exact) for a bf16 GEMM; the zero padding of Kp adds nothing."""
    def dequantized(data, scale):
        return (data.float() * scale.repeat_interleave(data.shape[1] // scale.shape[1], dim=1)).to(torch.bfloat16)

    return _in_dtype(dequantized(a, scale_a) @ dequantized(b, scale_b).t(), out_dtype)


@_mx_dequantized_mm_op.register_fake
def _(a, scale_a, b, scale_b, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def _in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`out` in `dtype`, with no `.to` when it already is: torch 2.11's dynamo turns the gradients of an
    autograd.Function to zeros when its forward returns a same-dtype `.to` (an alias of the product), so a
    compiled block learned only through its unconverted modules (2.14 is fixed; test_quantize_training.py's
    compiled test catches it on 2.11)."""
    return out if out.dtype == dtype else out.to(dtype)
