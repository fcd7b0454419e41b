"""grouped_mm_fp8(x [T, K], w [E, K, N], offsets [E]) -> [T, N]: grouped_mm with fp8 operands.

Same grouping as `grouped_mm` (rows sorted by expert, `offsets` the cumulative group ends, empty
groups allowed, any group size). Master weights, inputs and gradients stay in their dtype (bf16);
each GEMM quantises its operands on the fly (fp8_quant.py), accumulates in float32 and writes
the input's dtype. Which operand is quantised how:

    GEMM                      first operand                    second operand
    forward  x @ w[e]         x: e4m3, per row | 1x128         w[e]: e4m3, per output column | 128x128
    dgrad    dOut @ w[e]^T    dOut: grad_format, per row |     w[e]^T: e4m3, re-quantised per column of
                              1x128 along N                    w^T | the forward's 128x128 blocks
    wgrad    x_e^T dOut_e     x_e: e4m3, per column | per      dOut_e: grad_format, per column | per
                              128-token chunk and column       128-token chunk and column

(rowwise | blockwise.) Blockwise needs K and N to be multiples of 128 (refused otherwise: a
partial block would need its own scale layout); rows never need padding for the forward and
input gradient (masked), and the weight gradient zero-pads each expert to whole 128-row chunks
internally. On CUDA (sm_89+) the Triton kernels in kernels/scaled_gemm.py run; on CPU the torch
path dequantises the same fp8 values to float32 and multiplies per expert (an emulation with the
kernels' numerics up to float32 summation order). `TRITON_INTERPRET=1` runs the kernels on CPU.
On the Triton path the quantisation is Triton too (kernels/fp8_quantize.py, the same bits).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_moe.backend import Backend, resolve_backend
from dist_moe.fp8_quant import (
    BLOCK,
    FP8_DTYPES,
    Fp8Recipe,
    dequantize_blocks,
    padded_chunks,
    quantize_blocks,
    quantize_token_columns,
    resolve_recipe,
)
from dist_moe.grouped_mm import grouped_mm, loop_mm, loop_weight_grad
from dist_moe.host_sync import read_to_host

E4M3 = FP8_DTYPES["e4m3"]


def grouped_mm_fp8(x: Tensor, w: Tensor, offsets: Tensor, *, recipe: str | Fp8Recipe = "rowwise",
                   backend: Backend = "auto") -> Tensor:
    """out[rows of e] = x[rows of e] @ w[e] with fp8 operands; differentiable in x and w.

    `recipe`: an Fp8Recipe, or "rowwise" / "blockwise" (also titan-train's "fp8_rowwise" /
    "fp8_blockwise") for the default Fp8Recipe of that granularity. See the module docstring."""
    recipe = resolve_recipe(recipe)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [T, K] and w [E, K, N]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0]:
        raise ValueError(f"offsets must be [E={w.shape[0]}], got {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x and w must share one dtype of bfloat16, float16, float32; got {x.dtype} and {w.dtype}")
    if x.device != w.device or x.device != offsets.device:
        raise ValueError(f"x, w and offsets must be on one device; got {x.device}, {w.device}, {offsets.device}")
    k, n = w.shape[1], w.shape[2]
    if recipe.granularity == "blockwise" and (k % BLOCK or n % BLOCK):
        raise ValueError(f"blockwise fp8 needs K and N to be multiples of {BLOCK}; got K={k}, N={n} "
                         f"(use the rowwise recipe, or bf16 grouped_mm, for this GEMM)")
    resolved = resolve_backend(backend, x)
    if resolved == "triton":
        from dist_moe.kernels.fp8_launch import fp8_supported

        if not fp8_supported(x.device):
            raise ValueError(f"fp8 Triton kernels need a GPU of compute capability 8.9+ ({x.device} has less); "
                             f"use backend='torch' or bf16 grouped_mm")
    return _GroupedMMFp8.apply(x, w, offsets.to(torch.int32), recipe, resolved)


def _quantize_weight_forward(w: Tensor, blockwise: bool, backend: str) -> tuple[Tensor, Tensor]:
    """w [E, K, N] -> (q [E, K, N] view of a K-contiguous [E, N, K] buffer, scale in math layout:
    [E, N] rowwise, [E, K / 128, N / 128] blockwise)."""
    wt = w.transpose(1, 2)  # [E, N, K], the reduction axis last
    if blockwise:
        q, scale = quantize_blocks(wt, BLOCK, BLOCK, E4M3, backend)
        return q.transpose(1, 2), scale.transpose(1, 2)
    q, scale = quantize_blocks(wt, 1, wt.shape[2], E4M3, backend)
    return q.transpose(1, 2), scale.squeeze(2)


def _quantize_rows(t: Tensor, blockwise: bool, dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor]:
    """t [M, K] -> (q, scale [M] rowwise / [M, K / 128] blockwise) along K."""
    q, scale = quantize_blocks(t, 1, BLOCK if blockwise else t.shape[1], dtype, backend)
    return q, scale if blockwise else scale.squeeze(1)


class _GroupedMMFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor, recipe: Fp8Recipe, backend: str) -> Tensor:
        blockwise = recipe.granularity == "blockwise"
        ctx.recipe, ctx.backend = recipe, backend
        ctx.ends = _host_ends(offsets, x.shape[0]) if backend == "torch" else None
        xq, sx = _quantize_rows(x, blockwise, E4M3, backend)
        wq, sw = _quantize_weight_forward(w, blockwise, backend)
        # Blockwise dgrad reuses the forward's quantised weight (a 128x128 block is a block of w^T).
        ctx.save_for_backward(x, w, offsets, *((wq, sw) if blockwise else ()))
        return _scaled_mm(xq, sx, wq, sw, offsets, blockwise, x.dtype, backend, ctx.ends)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, w, offsets, *saved_wq = ctx.saved_tensors
        recipe, backend, ends = ctx.recipe, ctx.backend, ctx.ends
        blockwise = recipe.granularity == "blockwise"
        grad_dtype = FP8_DTYPES[recipe.grad_format]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if not recipe.fp8_dgrad:
                with torch.no_grad():
                    dx = grouped_mm(grad_out.to(w.dtype), w.transpose(1, 2), offsets, backend=backend)
            else:
                gq, sg = _quantize_rows(grad_out, blockwise, grad_dtype, backend)
                if blockwise:  # w^T's blocks: the forward's, transposed
                    wq, sw = saved_wq
                    wtq, swt = wq.transpose(1, 2), sw.transpose(1, 2)
                else:  # one scale per row of w[e] (a column of w[e]^T), along N
                    wtq_rows, swt = quantize_blocks(w, 1, w.shape[2], E4M3, backend)  # [E, K, N], scale [E, K, 1]
                    wtq, swt = wtq_rows.transpose(1, 2), swt.squeeze(2)
                dx = _scaled_mm(gq, sg, wtq, swt, offsets, blockwise, x.dtype, backend, ends)
        if ctx.needs_input_grad[1]:
            if recipe.fp8_wgrad:
                dw = _fp8_weight_grad(x, grad_out, w, offsets, recipe, backend, ends)
            else:
                dw = _bf16_weight_grad(x, grad_out.to(x.dtype), w, offsets, backend, ends)
        return dx, dw, None, None, None


def _scaled_mm(aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, offsets: Tensor, blockwise: bool,
               out_dtype: torch.dtype, backend: str, ends: list[int] | None) -> Tensor:
    """Dequantised aq [M, K] @ bq[e] [K, N] per group; scales as in kernels/fp8_launch.scaled_row_gemm."""
    if backend == "torch":
        if blockwise:
            a, b = dequantize_blocks(aq, sa, 1, BLOCK), dequantize_blocks(bq, sb, BLOCK, BLOCK)
        else:
            a, b = aq.float() * sa[:, None], bq.float() * sb[:, None, :]
        out = loop_mm(a, b, ends)
        # no same-dtype .to: torch 2.11's dynamo zeroes the gradients of an autograd.Function whose forward
        # returns one
        return out if out.dtype == out_dtype else out.to(out_dtype)
    from dist_moe.kernels.fp8_launch import scaled_row_gemm

    # Hopper's fp8 wgmma reads both operands K-major: make the reduction axis contiguous (an fp8
    # copy where it is not, e.g. w^T for the input gradient).
    aq = aq if aq.stride(1) == 1 else aq.contiguous()
    bq = bq if bq.stride(1) == 1 else bq.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty(aq.shape[0], bq.shape[2], device=aq.device, dtype=out_dtype)
    scaled_row_gemm(aq, sa, bq, sb, offsets, out, blockwise=blockwise)
    return out


def _fp8_weight_grad(x: Tensor, grad_out: Tensor, w: Tensor, offsets: Tensor, recipe: Fp8Recipe, backend: str,
                     ends: list[int] | None) -> Tensor:
    """dw[e] = x_e^T dOut_e with both operands quantised along the tokens (see the module docstring)."""
    chunks = padded_chunks(offsets, x.shape[0])
    xq_t, sx = quantize_token_columns(chunks.scatter(x), chunks, recipe.granularity, E4M3, backend)  # [K, P], [C, K]
    gq_t, sg = quantize_token_columns(chunks.scatter(grad_out), chunks, recipe.granularity,
                                      FP8_DTYPES[recipe.grad_format], backend)  # [N, P], [C, N]
    if backend == "torch":
        xp = dequantize_blocks(xq_t.t(), sx, BLOCK, 1)
        gp = dequantize_blocks(gq_t.t(), sg, BLOCK, 1)
        return loop_weight_grad(xp, gp, _padded_host_ends(ends), like=w.float()).to(w.dtype)
    from dist_moe.kernels.fp8_launch import scaled_weight_gemm

    dw = torch.empty_like(w)  # keeps w's layout (a transposed Linear weight stays transposed)
    scaled_weight_gemm(xq_t, sx, gq_t, sg, chunks.ends, dw)
    return dw


def _bf16_weight_grad(x: Tensor, grad_out: Tensor, w: Tensor, offsets: Tensor, backend: str,
                      ends: list[int] | None) -> Tensor:
    if backend == "torch":
        return loop_weight_grad(x, grad_out, ends, like=w)
    from dist_moe.kernels.launch import weight_gemm

    dw = torch.empty_like(w)
    weight_gemm(p=x, q=grad_out.contiguous(), ends=offsets, outs=(dw,))
    return dw


def _padded_host_ends(ends: list[int]) -> list[int]:
    """Each expert's end row in the 128-row chunk layout, from the host ends (no device read)."""
    out, start, padded_end = [], 0, 0
    for end in ends:
        padded_end += -(-(end - start) // BLOCK) * BLOCK
        out.append(padded_end)
        start = end
    return out


def _host_ends(offsets: Tensor, rows: int) -> list[int]:
    ends = read_to_host(offsets, "grouped_mm_fp8: per-expert row ends (torch path)")
    if any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] != rows):
        raise ValueError(f"offsets must be non-decreasing and end at T={rows}; got {ends}")
    return ends
