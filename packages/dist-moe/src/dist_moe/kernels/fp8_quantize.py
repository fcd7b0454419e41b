"""fp8 quantisation on the GPU (Triton): block amax, then quantise with the block scales.

A tensor seen as [B, R, C] (any strides) is scaled in blocks of block_rows x block_cols
(fp8_quant.quantize_blocks' contract). Two memory-bound passes, where the torch ops take about
eight over a float32 copy:
- `tile_amax_kernel`: per TILE_R x TILE_C tile, the amax over the tile's rows (REDUCE_R) and/or
  columns (REDUCE_C), into a small partial tensor that torch reduces to whole blocks;
- `quantize_tiles_kernel`: each tile divided by its blocks' scales (IEEE division, as the torch
  path: the same fp8 values bit for bit), clamped to +-max, cast round-to-nearest-even and stored
  with any output strides (a transposed output makes the GEMM's reduction axis contiguous).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(src_ptr, b, r0, c0, R, C, stride_b, stride_r, stride_c, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    rows = r0 + tl.arange(0, TILE_R)
    cols = c0 + tl.arange(0, TILE_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    ptrs = src_ptr + b.to(tl.int64) * stride_b + rows.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), rows, cols, mask


@triton.jit
def _round_to_fp8_grid(v, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """float32 v rounded to nearest-even onto the fp8 grid, still float32 (the cast after it is exact).

    Only under TRITON_INTERPRET=1: triton 3.8's interpreter casts float32 to fp8 by rounding half
    up on the first cut bit and ORs a carry out of the mantissa into the exponent (124.3 -> 64, not
    128), where the GPU's cvt.rn is right. Exact steps: the spacing is a power of two taken from
    v's exponent bits (the subnormal spacing below the smallest normal), v / spacing is exact, and
    adding and subtracting 1.5 * 2^23 rounds it to an integer nearest-even (|v / spacing| < 2^22)."""
    mag = tl.abs(v)
    exponent = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    spacing = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    steps = (mag / spacing + 12582912.0) - 12582912.0
    rounded = steps * spacing
    return tl.where(v < 0, -rounded, rounded)  # the sign kept on values that round to zero (-0.0, as cvt.rn)


@triton.jit
def tile_amax_kernel(src_ptr, amax_ptr, R, C, stride_b, stride_r, stride_c, stride_ab, stride_ar, stride_ac,
                     TILE_R: tl.constexpr, TILE_C: tl.constexpr, REDUCE_R: tl.constexpr, REDUCE_C: tl.constexpr):
    """Program (tile of rows, tile of columns, b): amax [B, R / TILE_R or R, C / TILE_C or C]."""
    tr, tc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, rows, cols, _ = _tile(src_ptr, b, tr * TILE_R, tc * TILE_C, R, C, stride_b, stride_r, stride_c,
                                TILE_R, TILE_C)
    mag = tl.abs(tile)
    base = amax_ptr + b.to(tl.int64) * stride_ab
    if REDUCE_R and REDUCE_C:
        tl.store(base + tr * stride_ar + tc * stride_ac, tl.max(tl.max(mag, axis=1), axis=0))
    elif REDUCE_R:
        tl.store(base + tr * stride_ar + cols * stride_ac, tl.max(mag, axis=0), mask=cols < C)
    else:
        tl.store(base + rows.to(tl.int64) * stride_ar + tc * stride_ac, tl.max(mag, axis=1), mask=rows < R)


@triton.jit
def quantize_tiles_kernel(src_ptr, scale_ptr, q_ptr, R, C, block_rows, block_cols,
                          stride_b, stride_r, stride_c, stride_sb, stride_sr, stride_sc,
                          stride_qb, stride_qr, stride_qc, FP8_MAX: tl.constexpr,
                          MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, ROUND_FIRST: tl.constexpr,
                          TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """q[b, r, c] = fp8(clamp(src / scale[b, r // block_rows, c // block_cols]))."""
    tr, tc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, rows, cols, mask = _tile(src_ptr, b, tr * TILE_R, tc * TILE_C, R, C, stride_b, stride_r, stride_c,
                                   TILE_R, TILE_C)
    scale_ptrs = (scale_ptr + b.to(tl.int64) * stride_sb + (rows // block_rows).to(tl.int64)[:, None] * stride_sr
                  + (cols // block_cols)[None, :] * stride_sc)
    scale = tl.load(scale_ptrs, mask=mask, other=1.0)
    q = tl.clamp(tl.math.div_rn(tile, scale), -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        q = _round_to_fp8_grid(q, MANTISSA_BITS, MIN_EXPONENT)
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + rows.to(tl.int64)[:, None] * stride_qr + cols[None, :] * stride_qc
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
