"""Row tiles of expert-sorted rows, and the padded row layout of the backward's GEMM operands.

Rows are sorted by expert; `offsets` [E] int32 holds each expert's end row. A row tile covers up
to BLOCK_M rows of one expert. `tile_map_kernel` (one program) writes, on the device, the table
the row kernels read, so no launch needs the per-expert counts on the host:

    info[t] = (expert, first row, end row, shift, fill end)   for row tiles t < max_tiles
    info[max_tiles] = (number of tiles in use, 0, 0, 0, 0)

Padded layout: expert e's rows start at a multiple of ALIGN rows and its last chunk is filled with
zero rows up to the next multiple, so a weight-gradient kernel sums whole ALIGN-row chunks
through TMA with no masks (a descriptor cannot stop at an expert's last row). Row r of expert e
sits at r + shift[e] there; rows [end row, fill end) of the expert's last tile are its zero rows.
`padded_ends` [E] receives each expert's padded end row. Buffers in this layout have
`padded_rows(rows, E)` rows.

`gather_rows_kernel` fills such a buffer: out[r + shift] = src[slot[r] // top_k] (a token's row,
the materialised gather), zero rows in the padding.
"""
from __future__ import annotations

import triton
import triton.language as tl

TILE_FIELDS = 5  # expert, first row, end row, shift, fill end
ROW_ALIGN = 64  # rows per chunk of the padded layout; weight kernels step BLOCK_R rows with ALIGN % BLOCK_R == 0


def padded_rows(rows: int, num_experts: int) -> int:
    """Rows of a buffer in the padded layout (an upper bound known without the counts)."""
    return rows + num_experts * (ROW_ALIGN - 1)


@triton.jit
def tile_map_kernel(offsets_ptr, info_ptr, padded_ends_ptr, num_experts, max_tiles,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, ALIGN: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    ends = tl.load(offsets_ptr + e, mask=e_ok, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=e_ok & (e > 0), other=0)
    counts = ends - starts
    tiles = tl.where(e_ok, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    tile_start = tile_end - tiles
    padded = tl.where(e_ok, (counts + ALIGN - 1) // ALIGN * ALIGN, 0)
    padded_end = tl.cumsum(padded, axis=0)
    shift = padded_end - padded - starts  # padded start - start
    fill_end = starts + padded  # in unpadded row numbers
    tl.store(padded_ends_ptr + e, padded_end, mask=e_ok)
    for t0 in range(0, max_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        # [BLOCK_T, BLOCK_E] one-hot: the expert whose tile range holds t (empty experts hold none).
        inside = (tile_start[None, :] <= t[:, None]) & (t[:, None] < tile_end[None, :])
        expert = tl.sum(tl.where(inside, e[None, :], 0), axis=1)
        first = tl.sum(tl.where(inside, starts[None, :] + (t[:, None] - tile_start[None, :]) * BLOCK_M, 0), axis=1)
        end = tl.sum(tl.where(inside, ends[None, :], 0), axis=1)
        tile_shift = tl.sum(tl.where(inside, shift[None, :], 0), axis=1)
        tile_fill = tl.sum(tl.where(inside, fill_end[None, :], 0), axis=1)
        ok = t < max_tiles
        base = info_ptr + t * 5
        tl.store(base, expert, mask=ok)
        tl.store(base + 1, first, mask=ok)
        tl.store(base + 2, end, mask=ok)
        tl.store(base + 3, tile_shift, mask=ok)
        tl.store(base + 4, tile_fill, mask=ok)
    tail = info_ptr + max_tiles * 5
    tl.store(tail, tl.sum(tiles, axis=0))
    for i in tl.static_range(1, 5):
        tl.store(tail + i, 0)


@triton.jit
def tile_rows(tile_info_ptr, tile):
    """(first row, end row, shift, fill end) of row tile `tile` of the table (TILE_FIELDS)."""
    info = tile_info_ptr + tile * 5
    return tl.load(info + 1), tl.load(info + 2), tl.load(info + 3), tl.load(info + 4)


@triton.jit
def gather_rows_kernel(src_ptr, out_ptr, tile_info_ptr, slot_ptr, max_tiles, num_cols, top_k,
                       stride_src, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row tile, column block): the tile's rows into the padded layout, zeros in its padding."""
    tile = tl.program_id(0)
    if tile < tl.load(tile_info_ptr + max_tiles * 5):
        m0, row_end, shift, fill_end = tile_rows(tile_info_ptr, tile)
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < num_cols
        token = tl.load(slot_ptr + rows, mask=row_ok, other=0) // top_k
        values = tl.load(src_ptr + token.to(tl.int64)[:, None] * stride_src + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        dest = (rows + shift).to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptr + dest, values, mask=(rows < fill_end)[:, None] & col_ok[None, :])
