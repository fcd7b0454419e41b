"""Row-tiled grouped GEMM (Triton): out[rows of expert e] = A[rows] @ B[e], one expert per tile.

Rows are sorted by expert; `offsets` [E] int32 holds each expert's end row. A tile covers
BLOCK_M rows of one expert and BLOCK_N output columns; the row-tile table comes from
`row_tiles.tile_map_kernel` (on the device, so the launch needs no host knowledge of the
per-expert counts: the grid is an upper bound and surplus programs find no tile). With
persistent launches a program loops over tiles.

Variants (constexpr), all fused into the same main loop and epilogue:
- A_GATHER: A row r is `a[slot[r] // top_k]`, gathered inside the kernel (no permuted copy).
- A_PADDED: A is in the padded row layout (row r at r + shift, see row_tiles.py).
- TWO_B: a second weight B2 with its own accumulator (gate and up projections share the A tile).
- CONCAT_K: acc += A2 @ B2 after A @ B (the two halves of the gate/up input gradient).
- EPILOGUE: STORE (out[r] = acc), SWIGLU (h = silu(acc) * acc2, also keeps both pre-activations),
  SCATTER (out[slot[r]] = acc * weight[slot[r]]: the combine). The SwiGLU backward is a separate
  memory-bound pass (swiglu_backward.py): in this epilogue its three extra tiles held the GEMM to
  128x128 tiles without persistence (2.18 ms against 1.24 + 0.29 ms split, H200).
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


# One function on purpose (issue 16): a single @triton.jit kernel whose loop structure and
# register use were tuned and measured on an H200 as written. Splitting it into @triton.jit
# helpers gains nothing (they are inlined anyway) and risks changing the generated code.
@triton.jit
def row_gemm_kernel(
    a_ptr, a_desc, a2_ptr, a2_desc,
    b_ptr, b_desc, b2_ptr, b2_desc,
    out_ptr, out2_ptr, out3_ptr,
    tile_info_ptr, slot_ptr, weight_ptr,
    N, K, K2, max_tiles, top_k,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_GATHER: tl.constexpr, A_PADDED: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
    B_K_CONTIG: tl.constexpr, TWO_B: tl.constexpr, CONCAT_K: tl.constexpr, EPILOGUE: tl.constexpr,
    SAVE_PREACT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    total_m = tl.load(tile_info_ptr + max_tiles * 5)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Non-persistent launches give each program at most one tile; persistent ones loop, and with
    # FLATTEN the compiler fuses this loop with the K loop so the next tile's loads overlap this
    # tile's epilogue.
    for tile in tl.range(tl.program_id(0), total_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        # Grouped ordering: GROUP_M row tiles sweep the N tiles together, so the B tiles they
        # share stay in L2.
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        group_rows = tl.minimum(total_m - first_m, GROUP_M)
        tile_m = first_m + (tile % width) % group_rows
        tile_n = (tile % width) // group_rows

        info = tile_info_ptr + tile_m * 5
        e = tl.load(info)
        m0 = tl.load(info + 1)
        row_end = tl.load(info + 2)
        if A_PADDED:
            shift = tl.load(info + 3)
        else:
            shift = 0
        n0 = tile_n * BLOCK_N
        rows = m0 + offs_m
        row_ok = rows < row_end
        cols = n0 + offs_n
        col_ok = cols < N

        if A_GATHER or EPILOGUE == 2:
            slot = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        if A_GATHER:
            a_row_offsets = (slot // top_k).to(tl.int64) * stride_am
            a_m0 = m0
        elif A_PADDED:
            a_row_offsets = (rows + shift).to(tl.int64) * stride_am
            a_m0 = m0 + shift
        else:
            a_row_offsets = rows.to(tl.int64) * stride_am
            a_m0 = m0

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TWO_B:
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = _load_a(a_ptr, a_desc, a_row_offsets, row_ok, a_m0, k, offs_k, K, stride_ak, A_TMA, EVEN_K)
            b = _load_b(b_ptr, b_desc, e, k, n0, offs_k, cols, col_ok, K, N, stride_be, stride_bk, stride_bn,
                        B_TMA, B_K_CONTIG, EVEN_K, EVEN_N, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if TWO_B:
                b2 = _load_b(b2_ptr, b2_desc, e, k, n0, offs_k, cols, col_ok, K, N, stride_be, stride_bk,
                             stride_bn, B_TMA, B_K_CONTIG, EVEN_K, EVEN_N, BLOCK_N, BLOCK_K)
                acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)
        if CONCAT_K:
            for k in range(0, K2, BLOCK_K):
                a = _load_a(a2_ptr, a2_desc, a_row_offsets, row_ok, a_m0, k, offs_k, K2, stride_ak, A_TMA,
                            EVEN_K)
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
        else:
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
                acc = acc * w[:, None]
            slot_offsets = slot.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_ptr + slot_offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
