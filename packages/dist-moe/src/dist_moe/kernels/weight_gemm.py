"""Per-expert reduction GEMM (Triton): out[e] = P[rows of e]^T @ Q[rows of e], the weight gradient.

A tile is a [BLOCK_K, BLOCK_N] block of out[e]; it sums the expert's rows in steps of BLOCK_R
rows. `ends` [E] int32 holds each expert's end row; empty experts get zero tiles, and nothing
about the counts is needed on the host.

Two ways to read P and Q:
- TMA (Hopper descriptors): the operands are in the padded row layout of row_tiles.py, so every
  expert's rows are whole BLOCK_R chunks (its zero rows fill the last one) and the main loop has
  no masks; `ends` are the padded ends.
- pointers: any row-major P and Q; rows past the expert's end are masked (the tail chunk).

Schedule: the tile loop and the row loop are one flattened loop written out here (the compiler's
loop fusion needs inner trip counts that do not vary, and here they follow the expert's rows):
a program takes tiles pid, pid + programs, ..., spending max(1, chunks of its expert) steps on
each; a step loads one chunk of P and Q, so the software pipeline prefetches the next tile's first
chunks while this tile's result is stored. A grid of one program per tile is the same loop run
for one tile. Tiles go in expert-major order, so the programs running together share one expert's
rows in L2.

SPLIT: out rows k >= SPLIT go to out2[e, k - SPLIT] (the gate and up weight gradients from one P
holding both gradients side by side); SPLIT = KP with one output. Outputs take any strides.
OUT_TMA: contiguous outputs are written by TMA stores (descriptors over [E * rows, NQ], rows a
multiple of BLOCK_K so no tile crosses experts): the warps hand the tile to the copy engine and go
on to the next tile's products instead of issuing the 64 KiB of stores themselves.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _programs_tiles_below(limit, pid, programs):
    """How many of this program's tiles (pid, pid + programs, ...) are below `limit` (per entry)."""
    return tl.maximum(limit - pid + programs - 1, 0) // programs


@triton.jit
def _rows_of(ends_ptr, e):
    start = tl.load(ends_ptr + tl.maximum(e - 1, 0))
    start = tl.where(e > 0, start, 0)
    return start, tl.load(ends_ptr + e)


@triton.jit
def _tile_origin(within, num_k, num_n, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """(k0, n0) of an expert's tile number `within`, in grouped order over its [num_k, num_n] tiles:
    GROUP_K K tiles at a time sweep all N, so programs running together share P and Q columns in L2."""
    width = GROUP_K * num_n
    first_k = (within // width) * GROUP_K
    group_rows = tl.minimum(num_k - first_k, GROUP_K)
    k0 = (first_k + (within % width) % group_rows) * BLOCK_K
    n0 = ((within % width) // group_rows) * BLOCK_N
    return k0, n0


@triton.jit
def _load_chunk(ptr, desc, r0, row_end, c0, offs_r, offs_c, C, stride_r, stride_c,
                TMA: tl.constexpr, EVEN_C: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) x columns [c0, c0 + BLOCK_C) of a row-major operand."""
    if TMA:
        tile = desc.load([r0, c0])
    else:
        rows = r0 + offs_r
        cols = c0 + offs_c
        ptrs = ptr + rows.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c
        if EVEN_C:
            tile = tl.load(ptrs, mask=(rows < row_end)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows < row_end)[:, None] & (cols < C)[None, :], other=0.0)
    return tile


# One function on purpose (issue 16): a single @triton.jit kernel whose loop structure and
# register use were tuned and measured on an H200 as written. Splitting it into @triton.jit
# helpers gains nothing (they are inlined anyway) and risks changing the generated code. The one
# exception, _tile_origin (shared with weight_gemm_specialized.py), compiles for sm_90 to the same
# PTX instructions as the inline code it replaced (compared for every shipped configuration).
@triton.jit
def weight_gemm_kernel(
    p_ptr, p_desc, q_ptr, q_desc, out_ptr, out2_ptr, out_desc, out2_desc, ends_ptr,
    KP, NQ, SPLIT, num_experts,
    stride_pr, stride_pk, stride_qr, stride_qn,
    stride_oe, stride_ok, stride_on,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_E: tl.constexpr, TMA: tl.constexpr, OUT_TMA: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_k = tl.cdiv(KP, BLOCK_K)
    num_n = tl.cdiv(NQ, BLOCK_N)
    per_expert = num_k * num_n
    # Steps of this program: expert e's tiles are [e * per_expert, (e + 1) * per_expert).
    ex = tl.arange(0, BLOCK_E)
    ex_ok = ex < num_experts
    ex_end = tl.load(ends_ptr + ex, mask=ex_ok, other=0)
    ex_start = tl.load(ends_ptr + ex - 1, mask=ex_ok & (ex > 0), other=0)
    ex_chunks = tl.maximum((ex_end - ex_start + BLOCK_R - 1) // BLOCK_R, 1)
    mine = (_programs_tiles_below((ex + 1) * per_expert, pid, programs)
            - _programs_tiles_below(ex * per_expert, pid, programs))
    steps = tl.sum(tl.where(ex_ok, mine * ex_chunks, 0), axis=0)

    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    # Loop state: the current tile, its chunk and what the loads need. The first step moves to
    # tile pid.
    tile = pid - programs
    chunk = 0
    chunks = 0
    e = 0
    k0 = 0
    n0 = 0
    row_start = 0
    row_end = 0
    zero = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc = zero
    for _ in range(0, steps):
        chunk += 1
        if chunk >= chunks:  # next tile
            tile += programs
            chunk = 0
            e = tile // per_expert
            k0, n0 = _tile_origin(tile % per_expert, num_k, num_n, GROUP_K, BLOCK_K, BLOCK_N)
            row_start, row_end = _rows_of(ends_ptr, e)
            chunks = tl.maximum((row_end - row_start + BLOCK_R - 1) // BLOCK_R, 1)
        r0 = row_start + chunk * BLOCK_R
        p = _load_chunk(p_ptr, p_desc, r0, row_end, k0, offs_r, offs_k, KP, stride_pr, stride_pk, TMA, EVEN_K)
        q = _load_chunk(q_ptr, q_desc, r0, row_end, n0, offs_r, offs_n, NQ, stride_qr, stride_qn, TMA, EVEN_N)
        acc = tl.dot(p.T, q, acc, input_precision=DOT_PRECISION)
        if chunk == chunks - 1:  # the tile's last chunk: store it, and start the next tile from zero
            # An empty expert's one step read rows of the next expert: its tile is zeros.
            tile_sum = tl.where(row_end > row_start, acc, 0.0).to(out_ptr.dtype.element_ty)
            if OUT_TMA:
                if k0 >= SPLIT:
                    out2_desc.store([e * (KP - SPLIT) + k0 - SPLIT, n0], tile_sum)
                else:
                    out_desc.store([e * SPLIT + k0, n0], tile_sum)
            else:
                ks = k0 + offs_k
                ns = n0 + offs_n
                mask = (ks < KP)[:, None] & (ns < NQ)[None, :]
                if k0 >= SPLIT:
                    base = out2_ptr
                    ks -= SPLIT
                else:
                    base = out_ptr
                offsets = e.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + ns[None, :] * stride_on
                tl.store(base + offsets, tile_sum, mask=mask)
            acc = zero  # a register select per step, as in the compiler's own loop fusion
