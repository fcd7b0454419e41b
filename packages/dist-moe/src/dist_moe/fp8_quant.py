"""fp8 recipes of the grouped expert GEMMs and their quantisation (torch ops: CPU and GPU, no host sync).

A quantised operand is (q, scale): q in float8 (e4m3: max 448, 3 mantissa bits; e5m2: max 57344,
2 mantissa bits), scale float32 with `value ~= q * scale` over one scaling block. The scale of a
block is amax(|block|) / format max (correctly rounded float32 on CPU and GPU alike; not rounded to a
power of two), so the block's largest entry
maps to the format's largest finite value; a block of zeros gets scale `_TINY / max` and stays 0.
Values are divided by the scale in float32 (IEEE division, so the quotient is the exact one
rounded to float32), clamped to +-max (the division may round one ulp past it) and cast
round-to-nearest-even; the tests' float64 reference defines the result the same way.

Recipes (`Fp8Recipe.granularity`):
- "rowwise": activations one scale per row (over the GEMM's reduction axis), weights one scale
  per output column per expert; in the backward each operand is re-quantised along that GEMM's
  own reduction axis (a scale along the reduced axis would not factor out of the sum).
- "blockwise" (DeepSeek-V3): activations 1x128 blocks along the reduction axis, weights 128x128
  blocks per expert. A 128x128 block is also a block of the transposed weight, so the input
  gradient reuses the forward's quantised weight, transposed.

The weight gradient reduces over the tokens of each expert, so its operands (x and dOut) are
scaled along the tokens: per expert and column (rowwise) or per 128-token chunk of an expert and
column (blockwise, DeepSeek-V3's 128x1 tiles); each expert's rows are zero-padded to whole
128-row chunks (`padded_chunks`) so no chunk mixes two experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Granularity = Literal["rowwise", "blockwise"]
Fp8Format = Literal["e4m3", "e5m2"]
FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 128  # DeepSeek-V3's block: 1x128 activations, 128x128 weights, 128-token chunks for the weight gradient
_TINY = 1e-12  # amax floor: a zero block gets a finite scale and quantises to zeros
# titan-train's --quantize.linear names that select a grouped-GEMM recipe here.
QUANTIZE_NAMES: dict[str, Granularity] = {"fp8_rowwise": "rowwise", "fp8_blockwise": "blockwise"}


@dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
    """How `grouped_mm_fp8` quantises its operands (see the module docstring)."""

    granularity: Granularity = "rowwise"
    """'rowwise' (per row / per output column per expert) or 'blockwise' (1x128 and 128x128 blocks)."""
    grad_format: Fp8Format = "e4m3"
    """Format of the output gradient in the backward GEMMs. e4m3 by default: with per-row or per-block
    scales the gradient's dynamic range is carried by the scales, so the extra mantissa bit of e4m3
    is worth more than e5m2's exponent range (DeepSeek-V3 and torchao's rowwise recipe do the same);
    e5m2 is the per-tensor-scaling choice, kept as an option."""
    fp8_dgrad: bool = True
    """Input gradient dOut @ W^T in fp8 (False: bf16 operands)."""
    fp8_wgrad: bool = True
    """Weight gradient x^T dOut in fp8 (False: bf16 operands, as torchao's 'rowwise_with_gw_hp')."""

    def __post_init__(self) -> None:
        if self.granularity not in ("rowwise", "blockwise"):
            raise ValueError(f"granularity must be 'rowwise' or 'blockwise', got {self.granularity!r}")
        if self.grad_format not in FP8_DTYPES:
            raise ValueError(f"grad_format must be one of {tuple(FP8_DTYPES)}, got {self.grad_format!r}")


def resolve_recipe(recipe: str | Fp8Recipe) -> Fp8Recipe:
    """An Fp8Recipe from itself, 'rowwise' / 'blockwise', or titan-train's 'fp8_rowwise' / 'fp8_blockwise'."""
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str):
        granularity = QUANTIZE_NAMES.get(recipe, recipe)
        if granularity in ("rowwise", "blockwise"):
            return Fp8Recipe(granularity=granularity)
    raise ValueError(f"recipe must be an Fp8Recipe or one of 'rowwise', 'blockwise', {tuple(QUANTIZE_NAMES)}; "
                     f"got {recipe!r}")


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_of(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 amax.clamp_min(_TINY) / max, correctly rounded on every device and under torch.compile.

    Not a float32 division by the Python float: torch's CUDA kernel multiplies by the float32 reciprocal
    (1 / 448 and 1 / 57344 are inexact), one ulp off the quotient in about half the blocks, and a value whose
    quotient lies within that ulp of an fp8 rounding midpoint then rounds to the other neighbour, a whole fp8
    step (on the H200 one e5m2 gradient value put the input gradient 7.2e-3 of its max off the float64
    reference). In float64 the quotient, whether divided or multiplied by the reciprocal (error < 2^-52), rounds
    to the right float32: max is 7 * 2^k for both formats, so amax / max is exact or has the period-3 binary
    fraction of m / 7, never within 2^-28 of a float32 rounding midpoint."""
    return (amax.clamp_min(_TINY).double() / fp8_max(dtype)).float()


def block_amax(t: Tensor, block_rows: int, block_cols: int, backend: str = "torch") -> Tensor:
    """t [..., R, C] -> amax(|block|) [..., R / block_rows, C / block_cols] float32 (blocks divide
    their axes). backend "triton": the GPU kernel (kernels/fp8_quantize.py), else torch ops."""
    *lead, rows, cols = t.shape
    assert rows % block_rows == 0 and cols % block_cols == 0, (t.shape, block_rows, block_cols)
    if backend == "triton":
        from dist_moe.kernels.fp8_launch import block_amax_triton

        return block_amax_triton(t, block_rows, block_cols)
    tiles = t.reshape(*lead, rows // block_rows, block_rows, cols // block_cols, block_cols)
    return tiles.abs().amax(dim=(-3, -1)).float()


def quantize_with_scale(t: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype,
                        backend: str = "torch", rows_contiguous: bool = False) -> Tensor:
    """q like t in `dtype`: fp8(clamp(t / scale of its block, +-max)); with `rows_contiguous` q's
    rows axis is its contiguous one (q.transpose(-1, -2) is then a compact tensor)."""
    if backend == "triton":
        from dist_moe.kernels.fp8_launch import quantize_with_scale_triton

        return quantize_with_scale_triton(t, scale, block_rows, block_cols, dtype, rows_contiguous)
    *lead, rows, cols = t.shape
    top = fp8_max(dtype)
    tiles = t.float().reshape(*lead, rows // block_rows, block_rows, cols // block_cols, block_cols)
    q = (tiles / scale[..., :, None, :, None]).clamp(-top, top).to(dtype).reshape(t.shape)
    return q.transpose(-1, -2).contiguous().transpose(-1, -2) if rows_contiguous else q


def quantize_blocks(t: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype, backend: str = "torch",
                    rows_contiguous: bool = False) -> tuple[Tensor, Tensor]:
    """t [..., R, C] in blocks of block_rows x block_cols (each dividing its axis) -> (q like t in
    `dtype`, scale [..., R / block_rows, C / block_cols] float32). Both backends give the same bits."""
    scale = scale_of(block_amax(t, block_rows, block_cols, backend), dtype)
    return quantize_with_scale(t, scale, block_rows, block_cols, dtype, backend, rows_contiguous), scale


def dequantize_blocks(q: Tensor, scale: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """float32 q * scale, the scale of each block repeated over it (inverse layout of quantize_blocks)."""
    wide = scale.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return q.float() * wide


@dataclass
class PaddedChunks:
    """Each expert's rows zero-padded to whole BLOCK-row chunks (device tensors, no host sync).

    `dest` [T] int64: row r's position in the padded buffer of `rows` rows (a multiple of BLOCK,
    an upper bound: T + E * (BLOCK - 1)); `ends` [E] int32: each expert's padded end row;
    `chunk_expert` [rows / BLOCK] int64: the expert of each chunk (the unused tail: the last expert,
    all zeros)."""

    dest: Tensor
    ends: Tensor
    chunk_expert: Tensor
    rows: int

    def scatter(self, t: Tensor) -> Tensor:
        out = t.new_zeros(self.rows, t.shape[1])
        return out.index_copy_(0, self.dest, t)


def padded_chunks(offsets: Tensor, num_rows: int) -> PaddedChunks:
    num_experts = offsets.shape[0]
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (ends - starts + BLOCK - 1) // BLOCK * BLOCK
    padded_ends = padded.cumsum(0)
    shift = padded_ends - padded - starts
    expert_of_row = torch.searchsorted(ends, torch.arange(num_rows, device=offsets.device), right=True)
    dest = torch.arange(num_rows, device=offsets.device) + shift[expert_of_row.clamp_max(num_experts - 1)]
    rows = (num_rows + num_experts * (BLOCK - 1) + BLOCK - 1) // BLOCK * BLOCK
    chunk_starts = torch.arange(rows // BLOCK, device=offsets.device) * BLOCK
    chunk_expert = torch.searchsorted(padded_ends, chunk_starts, right=True).clamp_max(num_experts - 1)
    return PaddedChunks(dest=dest, ends=padded_ends.to(torch.int32), chunk_expert=chunk_expert, rows=rows)


def quantize_token_columns(padded: Tensor, chunks: PaddedChunks, granularity: Granularity,
                           dtype: torch.dtype, backend: str = "torch") -> tuple[Tensor, Tensor]:
    """The weight gradient's operand: padded [P, C] rows -> (qT [C, P] in `dtype`, K-major for the
    GEMM, scale [P / BLOCK, C] float32): per chunk and column (blockwise) or per expert and column,
    repeated for each of the expert's chunks (rowwise)."""
    cols = padded.shape[1]
    amax = block_amax(padded, BLOCK, 1, backend)  # [chunks, C]
    if granularity == "rowwise":
        num_experts = chunks.ends.shape[0]
        index = chunks.chunk_expert[:, None].expand(amax.shape[0], cols)
        per_expert = amax.new_zeros(num_experts, cols).scatter_reduce_(0, index, amax, "amax")
        amax = per_expert.index_select(0, chunks.chunk_expert)
    scale = scale_of(amax, dtype)
    q = quantize_with_scale(padded, scale, BLOCK, 1, dtype, backend, rows_contiguous=True)
    return q.t(), scale
