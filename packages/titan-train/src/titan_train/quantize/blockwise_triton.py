"""The blockwise-scaled fp8 GEMM (DeepSeek-V3's recipe) in Triton: out [M, N] = a [M, K] . b [N, K]^T with
a scale per 1 x 128 tile of a (scale_a [M, K / 128]) and per `b_scale_rows` x 128 block of b (scale_b
[N / b_scale_rows, K / 128]: 128 for weights, 1 for the weight gradient's token tiles).

Each program owns a BLOCK_M x BLOCK_N tile of out and walks K in steps of 128 (one scale per row of a and
per column of b within a step): the step's product is accumulated in fp32 after multiplying by its scales.
K must be a multiple of 128 (scaling.quantize pads it with zeros). Under TRITON_INTERPRET=1 the same kernel
runs on CPU on fp32 tensors holding e4m3 values, which is how it is tested without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128


@triton.jit
def blockwise_gemm_kernel(a_ptr, b_ptr, out_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                          stride_am, stride_bn, stride_om, stride_sam, stride_sbn,
                          B_SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m, in_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        k = k_block * BLOCK_K + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=in_m[:, None], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None], mask=in_n[None, :], other=0.0)  # [K, N]
        scale_a = tl.load(scale_a_ptr + offs_m * stride_sam + k_block, mask=in_m, other=0.0)
        scale_b = tl.load(scale_b_ptr + (offs_n // B_SCALE_ROWS) * stride_sbn + k_block, mask=in_n, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * scale_a[:, None] * scale_b[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


# CUDA: tile shapes tried once per (M, N, K); BLOCK_K stays 128, the scales' granularity.
_CUDA_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                 for bm, bn, w, s in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (128, 256, 8, 3),
                                      (64, 256, 8, 3))]
blockwise_gemm_kernel_tuned = triton.autotune(configs=_CUDA_CONFIGS, key=["M", "N", "K"])(blockwise_gemm_kernel)


def _interpreted(kernel, wrap):
    """The interpreter's kernel, wrapped where this torch allows: torch 2.11's wrap_triton refuses interpreted
    kernels (torch 2.14's takes them); unwrapped, the custom op still runs eagerly, which is all the
    interpreter is for."""
    try:
        return wrap(kernel)
    except RuntimeError:
        return kernel


def launch(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *, b_scale_rows: int,
           out_dtype: torch.dtype, wrap=lambda kernel: kernel) -> torch.Tensor:
    """Run the kernel: autotuned tiles on CUDA, fixed 32 x 64 tiles elsewhere (the interpreter); `wrap`:
    torch.library.wrap_triton for torch.compile."""
    (m, k), n = a.shape, b.shape[0]
    assert k % BLOCK_K == 0 and b.shape[1] == k and scale_a.shape == (m, k // BLOCK_K), (a.shape, b.shape)
    assert scale_b.shape == (-(-n // b_scale_rows), k // BLOCK_K), (scale_b.shape, n, b_scale_rows)
    a, b, scale_a, scale_b = (t.contiguous() for t in (a, b, scale_a, scale_b))
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    args = (a, b, out, scale_a, scale_b, m, n, k, a.stride(0), b.stride(0), out.stride(0), scale_a.stride(0),
            scale_b.stride(0))
    if a.is_cuda:
        def grid(meta):
            return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

        wrap(blockwise_gemm_kernel_tuned)[grid](*args, B_SCALE_ROWS=b_scale_rows, BLOCK_K=BLOCK_K)
    else:  # the interpreter (TRITON_INTERPRET=1)
        from titan_models.kernels.triton_interpreter import backport_scalar_index

        backport_scalar_index()  # triton < 3.7's interpreter: the K loop's bound
        grid = (triton.cdiv(m, 32), triton.cdiv(n, 64))
        _interpreted(blockwise_gemm_kernel, wrap)[grid](*args, B_SCALE_ROWS=b_scale_rows, BLOCK_M=32, BLOCK_N=64,
                                                        BLOCK_K=BLOCK_K, num_warps=1)
    return out


@torch.library.triton_op("titan_train::fp8_blockwise_gemm", mutates_args=())
def _blockwise_gemm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       b_scale_rows: int, out_dtype: torch.dtype) -> torch.Tensor:
    # A custom op: torch.compile sees one node (with its shape function traced from this body) instead of
    # a graph break at the kernel launch.
    return launch(a, b, scale_a, scale_b, b_scale_rows=b_scale_rows, out_dtype=out_dtype,
                  wrap=torch.library.wrap_triton)


def blockwise_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
                   b_scale_rows: int, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] . b [N, K]^T with block scales (see the module docstring), in out_dtype."""
    return _blockwise_gemm_op(a, b, scale_a, scale_b, b_scale_rows, out_dtype)
