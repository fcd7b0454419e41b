"""MXFP8 on GPUs with MX tensor cores (sm_100+): tl.dot_scaled over e4m3 elements and e8m0 block scales.

Untested here (no such GPU); only `scaled_matmul` calls it, and only where `mx_native_supported` says the
device has the instructions. Elsewhere the MX recipe runs its GEMM on the exactly dequantised operands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scaling import QuantizedMatrix

MX_BLOCK = 32


@torch.compiler.assume_constant_result  # a property of the machine: no graph break, no guard per call
def mx_native_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales 2^s as e8m0 (the byte s + 127)."""
    _, exponent = torch.frexp(scale)
    return (exponent - 1 + 127).to(torch.uint8)


@triton.jit
def mx_gemm_kernel(a_ptr, b_ptr, out_ptr, scale_a_ptr, scale_b_ptr, M, N, K, stride_am, stride_bn, stride_om,
                   stride_sam, stride_sbn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k, offs_s = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_K // 32)
    in_m, in_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :], mask=in_m[:, None], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + (k0 + offs_k)[:, None], mask=in_n[None, :], other=0.0)
        s = k0 // 32 + offs_s
        scale_a = tl.load(scale_a_ptr + offs_m[:, None] * stride_sam + s[None, :], mask=in_m[:, None], other=0)
        scale_b = tl.load(scale_b_ptr + offs_n[:, None] * stride_sbn + s[None, :], mask=in_n[:, None], other=0)
        acc = tl.dot_scaled(a, scale_a, "e4m3", b, scale_b, "e4m3", acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def mx_scaled_gemm(a: QuantizedMatrix, b: QuantizedMatrix, *, out_dtype: torch.dtype) -> torch.Tensor:
    (m, k), n = a.data.shape, b.data.shape[0]
    block_k = 128 if k % 128 == 0 else MX_BLOCK
    scale_a, scale_b = e8m0_bytes(a.scale).contiguous(), e8m0_bytes(b.scale).contiguous()
    out = torch.empty(m, n, device=a.data.device, dtype=out_dtype)
    grid = (triton.cdiv(m, 128), triton.cdiv(n, 128))
    mx_gemm_kernel[grid](a.data, b.data, out, scale_a, scale_b, m, n, k, a.data.stride(0), b.data.stride(0),
                         out.stride(0), scale_a.stride(0), scale_b.stride(0), BLOCK_M=128, BLOCK_N=128,
                         BLOCK_K=block_k)
    return out
