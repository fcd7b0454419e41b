"""Per-expert reduction GEMM (Triton): out[e] = P[rows of e]^T @ Q[rows of e], the weight gradient.

A tile is a [BLOCK_K, BLOCK_N] block of out[e]; its program loops over the expert's rows in
chunks of BLOCK_R, so empty experts write zeros and no host knowledge of the counts is needed.
Tiles go to programs one each, or in a persistent loop over as many programs as SMs.
Variants (constexpr): P_GATHER / Q_GATHER read row `x[slot[r] // top_k]` inside the kernel,
Q_SCALE multiplies Q's row by weight[slot[r]] (the routing weight), TWO_Q adds a second Q with
its own output (gate and up weight gradients share the P tile). Outputs take any strides, so a
gradient is written directly in its parameter's Linear-style layout.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, row_offsets, row_ok, cols, col_ok, stride_c, EVEN: tl.constexpr):
    ptrs = ptr + row_offsets[:, None] + cols[None, :] * stride_c
    if EVEN:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return tile  # one return: early returns are not portable across triton versions


@triton.jit
def weight_gemm_kernel(
    p_ptr, q_ptr, q2_ptr, out_ptr, out2_ptr,
    offsets_ptr, slot_ptr, weight_ptr,
    KP, NQ, top_k, num_experts,
    stride_pr, stride_pk, stride_qr, stride_qn,
    stride_oe, stride_ok, stride_on,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr,
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, Q_SCALE: tl.constexpr, TWO_Q: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
):
    num_k = tl.cdiv(KP, BLOCK_K)
    num_n = tl.cdiv(NQ, BLOCK_N)
    tiles_per_expert = num_k * num_n
    offs_r = tl.arange(0, BLOCK_R)
    # Expert-major tile order; a non-persistent launch gives each program one tile.
    for tile in tl.range(tl.program_id(0), tiles_per_expert * num_experts, tl.num_programs(0), flatten=FLATTEN):
        _weight_tile(tile, tiles_per_expert, num_n, num_k, p_ptr, q_ptr, q2_ptr, out_ptr, out2_ptr, offsets_ptr,
                     slot_ptr, weight_ptr, KP, NQ, top_k, stride_pr, stride_pk, stride_qr, stride_qn,
                     stride_oe, stride_ok, stride_on, offs_r, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_K,
                     P_GATHER, Q_GATHER, Q_SCALE, TWO_Q, EVEN_K, EVEN_N, DOT_PRECISION)


@triton.jit
def _weight_tile(tile, tiles_per_expert, num_n, num_k, p_ptr, q_ptr, q2_ptr, out_ptr, out2_ptr, offsets_ptr,
                 slot_ptr, weight_ptr, KP, NQ, top_k, stride_pr, stride_pk, stride_qr, stride_qn,
                 stride_oe, stride_ok, stride_on, offs_r,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr,
                 P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, Q_SCALE: tl.constexpr, TWO_Q: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    e = tile // tiles_per_expert
    pid = tile % tiles_per_expert
    # Grouped ordering over the [num_k, num_n] output tiles of this expert (L2 reuse of P and Q rows).
    width = GROUP_K * num_n
    first_k = (pid // width) * GROUP_K
    group_rows = tl.minimum(num_k - first_k, GROUP_K)
    tile_k = first_k + (pid % width) % group_rows
    tile_n = (pid % width) // group_rows

    row_start = tl.where(e > 0, tl.load(offsets_ptr + tl.maximum(e - 1, 0)), 0)
    row_end = tl.load(offsets_ptr + e)
    ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < KP
    n_ok = ns < NQ

    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if TWO_Q:
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + offs_r
        row_ok = rows < row_end
        if (P_GATHER or Q_GATHER) or Q_SCALE:  # chained and/or needs parentheses in older triton
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        if P_GATHER:
            p_rows = (slot // top_k).to(tl.int64)
        else:
            p_rows = rows.to(tl.int64)
        if Q_GATHER:
            q_rows = (slot // top_k).to(tl.int64)
        else:
            q_rows = rows.to(tl.int64)
        p = _load_rows(p_ptr, p_rows * stride_pr, row_ok, ks, k_ok, stride_pk, EVEN_K)  # [BLOCK_R, BLOCK_K]
        q = _load_rows(q_ptr, q_rows * stride_qr, row_ok, ns, n_ok, stride_qn, EVEN_N)  # [BLOCK_R, BLOCK_N]
        if Q_SCALE:
            w = tl.load(weight_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * w[:, None]).to(q_ptr.dtype.element_ty)
        acc = tl.dot(p.T, q, acc, input_precision=DOT_PRECISION)
        if TWO_Q:
            q2 = _load_rows(q2_ptr, q_rows * stride_qr, row_ok, ns, n_ok, stride_qn, EVEN_N)
            acc2 = tl.dot(p.T, q2, acc2, input_precision=DOT_PRECISION)

    out_offsets = e.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + ns[None, :] * stride_on
    mask = k_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if TWO_Q:
        tl.store(out2_ptr + out_offsets, acc2.to(out2_ptr.dtype.element_ty), mask=mask)
