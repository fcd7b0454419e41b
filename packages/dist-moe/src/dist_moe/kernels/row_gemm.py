"""Row-tiled grouped GEMM (Triton): out[rows of expert e] = A[rows] @ B[e], one expert per tile.

Rows are sorted by expert; `offsets` [E] int32 holds each expert's end row. A tile covers
BLOCK_M rows of one expert and BLOCK_N output columns. `tile_ends` [E] int32 (cumulative
ceil(rows_e / BLOCK_M), made on the device by the launcher) maps a tile to its expert by binary
search, so the launch needs no host knowledge of the per-expert counts: the grid is an upper
bound and surplus programs find no tile. With PERSISTENT launches, a program loops over tiles.

Variants (constexpr), all fused into the same main loop and epilogue:
- A_GATHER: A row r is `a[slot[r] // top_k]`, gathered inside the kernel (no permuted copy).
- TWO_B: a second weight B2 with its own accumulator (gate and up projections share the A tile).
- CONCAT_K: acc += A2 @ B2 after A @ B (the two halves of the gate/up input gradient).
- EPILOGUE: STORE (out[r] = acc), SWIGLU (h = silu(acc) * acc2, also keeps both pre-activations),
  SCATTER (out[slot[r]] = acc * weight[slot[r]]: the combine), SWIGLU_BWD (see `_swiglu_bwd`).
- A_TMA / B_TMA: operands through Hopper TMA descriptors (host-built) instead of pointer loads.

B[e] is the math layout [K, N]; B_K_CONTIG says K is its contiguous axis (a Linear-style weight
[E, N, K] seen transposed); a TMA descriptor then covers [E*N, K], otherwise [E*K, N].
"""
from __future__ import annotations

import triton
import triton.language as tl

EPILOGUE_STORE = 0
EPILOGUE_SWIGLU = 1
EPILOGUE_SCATTER = 2
EPILOGUE_SWIGLU_BWD = 3


@triton.jit
def expert_of_tile(tile_m, tile_ends_ptr, num_experts, LOG2_E: tl.constexpr):
    """First expert e with tile_ends[e] > tile_m (tile_ends is non-decreasing)."""
    lo = tile_m * 0
    hi = lo + num_experts
    for _ in tl.static_range(LOG2_E):
        mid = (lo + hi) // 2
        ends = tl.load(tile_ends_ptr + tl.minimum(mid, num_experts - 1))
        active = lo < hi
        right = ends <= tile_m
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (~right), mid, hi)
    return lo


@triton.jit
def _load_b(b_ptr, b_desc, e, k, n0, offs_k, cols, col_ok, K, N,
            stride_be, stride_bk, stride_bn,
            B_TMA: tl.constexpr, B_K_CONTIG: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of B[e] at (k, n0)."""
    if B_TMA:
        if B_K_CONTIG:
            tile = b_desc.load([e * N + n0, k]).T  # descriptor over [E*N, K]
        else:
            tile = b_desc.load([e * K + k, n0])  # over [E*K, N]; the launcher checks K % BLOCK_K == 0
    else:
        ptrs = (b_ptr + e.to(tl.int64) * stride_be + (k + offs_k)[:, None] * stride_bk
                + cols[None, :] * stride_bn)
        if EVEN_K and EVEN_N:
            tile = tl.load(ptrs)
        elif EVEN_K:
            tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=((k + offs_k) < K)[:, None] & col_ok[None, :], other=0.0)
    return tile


@triton.jit
def _load_a(a_ptr, a_desc, a_row_offsets, row_ok, m0, k, offs_k, K, stride_ak,
            A_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of A at (rows, k); `a_row_offsets` already include the row stride."""
    if A_TMA:
        tile = a_desc.load([m0, k])  # rows past the group belong to other experts: never stored
    else:
        ptrs = a_ptr + a_row_offsets[:, None] + (k + offs_k)[None, :] * stride_ak
        if EVEN_K:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
    return tile


@triton.jit
def row_gemm_kernel(
    a_ptr, a_desc, a2_ptr, a2_desc,
    b_ptr, b_desc, b2_ptr, b2_desc,
    out_ptr, out2_ptr, out3_ptr,
    aux_ptr, aux2_ptr, aux3_ptr,
    offsets_ptr, tile_ends_ptr, slot_ptr, weight_ptr, partial_ptr,
    N, K, K2, num_experts, num_slots, top_k,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    LOG2_E: tl.constexpr,
    A_GATHER: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_K_CONTIG: tl.constexpr,
    TWO_B: tl.constexpr, CONCAT_K: tl.constexpr, EPILOGUE: tl.constexpr,
    SAVE_PREACT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    total_m = tl.load(tile_ends_ptr + num_experts - 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Non-persistent launches give each program at most one tile; persistent ones loop.
    for tile in range(tl.program_id(0), total_m * num_n, tl.num_programs(0)):
        # Grouped ordering: GROUP_M row tiles sweep the N tiles together, so the B tiles they
        # share stay in L2.
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        group_rows = tl.minimum(total_m - first_m, GROUP_M)
        tile_m = first_m + (tile % width) % group_rows
        tile_n = (tile % width) // group_rows

        e = expert_of_tile(tile_m, tile_ends_ptr, num_experts, LOG2_E)
        prev = tl.maximum(e - 1, 0)
        first_tile_e = tl.where(e > 0, tl.load(tile_ends_ptr + prev), 0)
        row_start = tl.where(e > 0, tl.load(offsets_ptr + prev), 0)
        row_end = tl.load(offsets_ptr + e)
        m0 = row_start + (tile_m - first_tile_e) * BLOCK_M
        n0 = tile_n * BLOCK_N
        rows = m0 + offs_m
        row_ok = rows < row_end
        cols = n0 + offs_n
        col_ok = cols < N

        if A_GATHER or EPILOGUE == 2 or EPILOGUE == 3:
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        if A_GATHER:
            a_row_offsets = (slot // top_k).to(tl.int64) * stride_am
        else:
            a_row_offsets = rows.to(tl.int64) * stride_am

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TWO_B:
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = _load_a(a_ptr, a_desc, a_row_offsets, row_ok, m0, k, offs_k, K, stride_ak, A_TMA, EVEN_K)
            b = _load_b(b_ptr, b_desc, e, k, n0, offs_k, cols, col_ok, K, N, stride_be, stride_bk, stride_bn,
                        B_TMA, B_K_CONTIG, EVEN_K, EVEN_N, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if TWO_B:
                b2 = _load_b(b2_ptr, b2_desc, e, k, n0, offs_k, cols, col_ok, K, N, stride_be, stride_bk,
                             stride_bn, B_TMA, B_K_CONTIG, EVEN_K, EVEN_N, BLOCK_N, BLOCK_K)
                acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)
        if CONCAT_K:
            for k in range(0, K2, BLOCK_K):
                a = _load_a(a2_ptr, a2_desc, a_row_offsets, row_ok, m0, k, offs_k, K2, stride_ak, A_TMA, EVEN_K)
                b = _load_b(b2_ptr, b2_desc, e, k, n0, offs_k, cols, col_ok, K2, N, stride_be, stride_bk,
                            stride_bn, B_TMA, B_K_CONTIG, EVEN_K, EVEN_N, BLOCK_N, BLOCK_K)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        mask = row_ok[:, None] & col_ok[None, :]
        row_offsets = rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        if EPILOGUE == 0:
            tl.store(out_ptr + row_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
        elif EPILOGUE == 1:
            # h = silu(gate) * up from the float32 accumulators; gate and up kept for the backward.
            h = acc * tl.sigmoid(acc) * acc2
            tl.store(out_ptr + row_offsets, h.to(out_ptr.dtype.element_ty), mask=mask)
            if SAVE_PREACT:
                tl.store(out2_ptr + row_offsets, acc.to(out2_ptr.dtype.element_ty), mask=mask)
                tl.store(out3_ptr + row_offsets, acc2.to(out3_ptr.dtype.element_ty), mask=mask)
        elif EPILOGUE == 2:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
                acc = acc * w[:, None]
            slot_offsets = slot.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_ptr + slot_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            _swiglu_bwd(acc, row_offsets, mask, row_ok, slot, tile_n, num_slots, out_ptr, out2_ptr,
                        aux_ptr, aux2_ptr, aux3_ptr, weight_ptr, partial_ptr, HAS_WEIGHT)


@triton.jit
def _swiglu_bwd(acc, offsets, mask, row_ok, slot, tile_n, num_slots, dgate_ptr, dup_ptr,
                gate_ptr, up_ptr, h_ptr, weight_ptr, partial_ptr, HAS_WEIGHT: tl.constexpr):
    """acc = dOut[token] @ W2^T, the gradient of h before the routing weight w.

    d w = <dOut[token], h @ W2> = sum over columns of acc * h: each N tile writes its partial sum
    to partial[tile_n, slot] (summed by the launcher, deterministically). Then dh = w * acc and
    the SwiGLU backward gives d gate = dh * up * silu'(gate), d up = dh * silu(gate).
    """
    if HAS_WEIGHT:
        h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(partial_ptr + tile_n.to(tl.int64) * num_slots + slot, tl.sum(acc * h, axis=1), mask=row_ok)
        w = tl.load(weight_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    dgate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    dup = acc * gate * sig
    tl.store(dgate_ptr + offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, dup.to(dup_ptr.dtype.element_ty), mask=mask)
