"""Quantising a matrix to fp8 with dynamic, power-of-two scales, one scale per block of it.

Every operand of a GEMM is handed over with its reduction dimension last: a matrix [R, C] that the GEMM
reduces along C. A block is `rows x cols` elements (0: the whole dimension), so one routine covers
    tensorwise  rows=0, cols=0     one scale for the tensor
    rowwise     rows=1, cols=0     one scale per row (per token of an activation, per output channel of a weight)
    1x128       rows=1, cols=128   DeepSeek-V3's activation tiles
    128x128     rows=128, cols=128 DeepSeek-V3's weight blocks
    mx          rows=1, cols=32    OCP MX v1.0 blocks (the scale rule is the spec's, see `mx_exponent`)

The scale of a block is 2^-p: the data are x * 2^p rounded to the fp8 format (round-to-nearest-even,
saturated at its largest finite value), the dequantised values data * 2^-p. A power of two makes both
steps exact (no rounding beside the fp8 cast itself), makes every dequantised e4m3 value a bf16 value, and
costs at most one binade of headroom against amax / fmax (the block's largest element lands in
(fmax / 2, fmax]). p = largest integer with amax * 2^p <= fmax, from frexp (exact, unlike log2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# e8m0 (the MX scale format) spans 2^-127 .. 2^127; amax-based scales are kept in the same range, so every
# scale is a normal or subnormal fp32 number and an all-zero block gets p = 0.
MAX_SCALE_EXPONENT = 127
E4M3_EMAX = 8  # OCP MX v1.0 table 1: emax of FP8 E4M3 elements


@dataclass(frozen=True)
class Blocking:
    """How an operand [R, C] (reduction along C) is cut into blocks that share a scale."""

    rows: int
    """Rows per block (0: all rows)."""
    cols: int
    """Reduction-dimension elements per block (0: the whole reduction dimension)."""
    dtype: torch.dtype = E4M3
    """fp8 element format: e4m3 (3 mantissa bits, max 448) or e5m2 (2 bits, max 57344)."""
    rule: Literal["amax", "mx"] = "amax"
    """amax: 2^p with amax * 2^p <= fmax. mx: the OCP MX scale 2^(floor(log2 amax) - emax_elem)."""
    pad_cols: int = 1
    """Zero-pad the reduction dimension to a multiple of this (torch._scaled_mm needs 16)."""


@dataclass
class QuantizedMatrix:
    """data [R, Cp] fp8 (C zero-padded to Cp), scale [R / rows, Cp / cols] fp32 powers of two (dequantised
    value = data * scale over each block); `cols` is the unpadded reduction length."""

    data: torch.Tensor
    scale: torch.Tensor
    blocking: Blocking
    cols: int
    exponent: torch.Tensor | None = None
    """[R / rows, Cp / cols] int32: scale = 2^-exponent (None where the matrix came quantised from elsewhere)."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[R, C] in `dtype` (exact in fp32; exact in bf16 for e4m3 and e5m2 data)."""
        return (self.data.to(torch.float32) * self.scale_per_element()).to(dtype)[:, :self.cols]

    def scale_per_element(self) -> torch.Tensor:
        """[R, Cp]: each element's block scale."""
        rows, cols = self.data.shape
        block_rows = self.blocking.rows or rows
        per_row = self.scale.repeat_interleave(block_rows, dim=0)[:rows]
        return per_row.repeat_interleave(cols // self.scale.shape[1], dim=1)


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def amax_exponent(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest integer p with amax * 2^p <= fmax (int32); 0 where amax is 0."""
    fmax_mantissa, fmax_exponent = math.frexp(fp8_max(dtype))  # 448 = 0.875 2^9, 57344 = 0.875 2^16
    mantissa, exponent = torch.frexp(amax.to(torch.float32))  # amax = m 2^e, m in [0.5, 1)
    p = fmax_exponent - exponent - (mantissa > fmax_mantissa).to(torch.int32)
    return torch.where(amax > 0, p, torch.zeros_like(p)).clamp(-MAX_SCALE_EXPONENT, MAX_SCALE_EXPONENT)


def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0 (section 6.3): shared scale X = 2^(floor(log2 amax) - emax_elem), clamped to e8m0's range;
    returned as p = -log2 X so that elements are V * 2^p. floor(log2 amax) is frexp's exponent - 1 (exact).
    An all-zero block has no log2: it gets X = 2^-127 (e8m0's smallest; its elements are zero anyway)."""
    _, exponent = torch.frexp(amax.to(torch.float32))
    scale_exponent = torch.where(amax > 0, exponent - 1 - E4M3_EMAX, torch.full_like(exponent, -MAX_SCALE_EXPONENT))
    return -scale_exponent.clamp(-MAX_SCALE_EXPONENT, MAX_SCALE_EXPONENT)


def quantize(matrix: torch.Tensor, blocking: Blocking, *, amax_group=None,
             exponent: torch.Tensor | None = None) -> QuantizedMatrix:
    """`matrix` [R, C] (any float dtype) as fp8 blocks with one power-of-two scale each.

    amax_group: a process group over which `matrix` is one shard of a larger matrix whose blocks span the
    shards (tensorwise under tensor parallelism): the block amaxes are max-reduced over it, so every shard
    gets the scales of the whole matrix (the same bits as quantising it whole, then slicing).
    exponent: the blocks' exponents p [Rp / rows, Cp / cols], already known (the block amaxes are then not
    computed, nor reduced): a backward operand that is the transpose of a forward one with transposed blocks
    (see `transposed_exponent`) takes the forward's, which is what its own amaxes would give, so the result
    is the same bits for one pass over the matrix fewer."""
    assert matrix.dim() == 2, matrix.shape
    rows, cols = matrix.shape
    x = matrix.to(torch.float32)
    if blocking.cols:
        block_cols = blocking.cols
        padded_cols = _round_up(cols, math.lcm(block_cols, blocking.pad_cols))
    else:
        block_cols = padded_cols = _round_up(cols, blocking.pad_cols)
    block_rows = blocking.rows or rows
    padded_rows = _round_up(rows, block_rows)
    if (padded_rows, padded_cols) != (rows, cols):  # zeros change no block's amax
        x = F.pad(x, (0, padded_cols - cols, 0, padded_rows - rows))
    x = x.contiguous()  # row-major data, as torch._scaled_mm wants its first operand (x may be a transpose)
    # x [Rp, Cp] -> blocks [Rp / br, br, Cp / bc, bc]
    grid = (padded_rows // block_rows, padded_cols // block_cols)
    blocks = x.reshape(grid[0], block_rows, grid[1], block_cols)
    if exponent is None:
        amax = blocks.abs().amax(dim=(1, 3))  # [Rp / br, Cp / bc]
        if amax_group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
        p = mx_exponent(amax) if blocking.rule == "mx" else amax_exponent(amax, blocking.dtype)
    else:
        if tuple(exponent.shape) != grid:
            raise ValueError(f"quantize: exponent of shape {tuple(exponent.shape)} for a {rows} x {cols} matrix "
                             f"in {block_rows} x {block_cols} blocks (grid {grid})")
        p = exponent.to(torch.int32)
    fmax = fp8_max(blocking.dtype)
    scaled = torch.ldexp(blocks, p[:, None, :, None].to(torch.float32))  # exact: a power of two
    data = scaled.clamp(-fmax, fmax).to(blocking.dtype).reshape(padded_rows, padded_cols)[:rows]
    scale = torch.ldexp(torch.ones(grid, dtype=torch.float32, device=x.device), (-p).to(torch.float32))
    return QuantizedMatrix(data=data, scale=scale, blocking=blocking, cols=cols, exponent=p)


def transposed_exponent(quantized: QuantizedMatrix, blocking_t: Blocking) -> torch.Tensor | None:
    """The exponents of `quantized`'s matrix transposed and quantised with `blocking_t`, when they are its own
    transposed: each block of the transpose is a block of the matrix transposed (rows x cols blocks become
    cols x rows ones: tensorwise 0 x 0, 128 x 128 weight blocks), in the same format, rule and block grid.
    None otherwise (rowwise: a row's scale is no column's; the transpose must be quantised from scratch)."""
    b, q = quantized.blocking, quantized
    if q.exponent is None or (b.rows, b.cols) != (blocking_t.cols, blocking_t.rows):
        return None
    if (b.dtype, b.rule) != (blocking_t.dtype, blocking_t.rule):
        return None
    rows = q.data.shape[0]
    # the transpose [C, R]: C in blocks of b.cols (its rows), R padded as blocking_t pads its reduction
    t_rows = _round_up(q.cols, b.cols) // b.cols if b.cols else 1
    t_padded = _round_up(rows, math.lcm(b.rows, blocking_t.pad_cols) if b.rows else blocking_t.pad_cols)
    t_cols = t_padded // b.rows if b.rows else 1
    return q.exponent.t() if tuple(q.exponent.shape) == (t_cols, t_rows) else None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
