"""fp8 grouped GEMMs with dequantising epilogues (Triton): float8 operands, float32 scales and accumulation.

`scaled_row_gemm_kernel`: out[rows of e] = (A[rows] @ B[e]) dequantised, one expert per row tile
(the tile table of row_tiles.tile_map_kernel, so no host knowledge of the per-expert counts).
- ROWWISE: A has one scale per row, B[e] one per output column; the float32 accumulator is
  scaled once, after the K loop.
- BLOCKWISE: A has one scale per row per SCALE_BLOCK columns of K, B[e] one per SCALE_BLOCK x
  SCALE_BLOCK block; each K step's product (BLOCK_K divides SCALE_BLOCK, so a step lies in one
  block) is scaled before it joins the accumulator (DeepSeek-V3's promotion to float32 at every
  block of K).

`scaled_weight_gemm_kernel`: out[e] = sum over the expert's SCALE_BLOCK-row chunks c of
(P_c^T Q_c) * sp[c, :, None] * sq[c, None, :]: the weight gradient, P^T and Q^T stored K-major
([cols, padded rows], the rows contiguous, which is what Hopper's fp8 wgmma wants for both
operands), the rows in the zero-padded chunk layout of fp8_quant.padded_chunks (every expert
starts at a chunk; `ends` its padded end). One program per (output tile, expert); an empty
expert stores zeros.

Rows and columns past the operands' ends are masked (loads of 0), so any group size works.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scaled_row_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, tile_info_ptr,
    N, K, max_tiles,
    stride_am, stride_ak, stride_sam, stride_sak,
    stride_be, stride_bk, stride_bn, stride_sbe, stride_sbk, stride_sbn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCKWISE: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    tile = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    total_m = tl.load(tile_info_ptr + max_tiles * 5)
    if tile < total_m * num_n:  # the grid is an upper bound: surplus programs find no tile
        # Grouped ordering: GROUP_M row tiles sweep the N tiles together (B tiles stay in L2).
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        group_rows = tl.minimum(total_m - first_m, GROUP_M)
        tile_m = first_m + (tile % width) % group_rows
        tile_n = (tile % width) // group_rows
        info = tile_info_ptr + tile_m * 5
        e = tl.load(info).to(tl.int64)
        m0 = tl.load(info + 1)
        row_end = tl.load(info + 2)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
        b_base = b_ptr + e * stride_be + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + offs_k
            if EVEN_K:
                a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
            b_ptrs = b_base + ks[:, None] * stride_bk
            if EVEN_K and EVEN_N:
                b = tl.load(b_ptrs)
            elif EVEN_K:
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=(ks < K)[:, None] & col_ok[None, :], other=0.0)
            if BLOCKWISE:
                kb = k // SCALE_BLOCK
                sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam + kb * stride_sak, mask=row_ok, other=0.0)
                sb = tl.load(sb_ptr + e * stride_sbe + kb * stride_sbk + (cols // SCALE_BLOCK) * stride_sbn,
                             mask=col_ok, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            else:
                acc = tl.dot(a, b, acc)
        if not BLOCKWISE:
            sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam, mask=row_ok, other=0.0)
            sb = tl.load(sb_ptr + e * stride_sbe + cols * stride_sbn, mask=col_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def scaled_weight_gemm_kernel(
    p_ptr, sp_ptr, q_ptr, sq_ptr, out_ptr, ends_ptr,
    KP, NQ,
    stride_pk, stride_pr, stride_qn, stride_qr, stride_spc, stride_sqc,
    stride_oe, stride_ok, stride_on,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    e = tl.program_id(1)
    num_n = tl.cdiv(NQ, BLOCK_N)
    ks = (tl.program_id(0) // num_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < KP
    n_ok = ns < NQ
    offs_r = tl.arange(0, BLOCK_R)
    start = tl.load(ends_ptr + tl.maximum(e - 1, 0))
    # Padded ends are multiples of SCALE_BLOCK: saying so lets the row loads be aligned vectors
    # (cp.async needs >= 4 aligned bytes; without it every fp8 load is a byte and nothing pipelines).
    start = tl.multiple_of(tl.where(e > 0, start, 0), SCALE_BLOCK)
    end = tl.load(ends_ptr + e)
    p_cols = p_ptr + ks.to(tl.int64)[:, None] * stride_pk
    q_cols = q_ptr + ns.to(tl.int64)[None, :] * stride_qn
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for step in range(0, (end - start) // BLOCK_R):  # padded rows: whole chunks, no row mask
        r0 = tl.multiple_of(start + step * BLOCK_R, BLOCK_R)
        # int32 along the contiguous axis (an int64 cast there hides its contiguity from the
        # compiler: no vector loads, no cp.async pipelining)
        r = r0 + offs_r
        p = tl.load(p_cols + r[None, :] * stride_pr, mask=k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
        q = tl.load(q_cols + r[:, None] * stride_qr, mask=n_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        c = r0 // SCALE_BLOCK
        sp = tl.load(sp_ptr + c * stride_spc + ks, mask=k_ok, other=0.0)
        sq = tl.load(sq_ptr + c * stride_sqc + ns, mask=n_ok, other=0.0)
        acc += tl.dot(p, q) * (sp[:, None] * sq[None, :])
    out_ptrs = out_ptr + e.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + ns[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])
