"""Blockwise fp8 (e4m3) quantization: one fp32 scale per (rows, cols) tile.

scales="amax": scale = amax(|tile|) / 448 (1 for an all-zero tile), q = fp8(clamp(x / scale, -448, 448)).
scales="pow2": scale = 2^-p with p the largest integer such that amax * 2^p <= 448 (from frexp, exact; 0 for
an all-zero tile; |p| <= 127), q = fp8(clamp(x * 2^p, -448, 448)): both steps exact but for the fp8 rounding,
and q * scale is the dequantized value exactly (DeepSeek-V3-style fp8 training's scales).
Every step is elementwise or a max within one tile, so quantizing a tile-aligned piece gives
exactly the bits that quantizing the whole matrix gives for that piece: a rank can quantize its own
tiles and the gathered result equals gather-then-quantize bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def _tiled(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [R, C] zero-padded to whole tiles and viewed as [tile_rows, br, tile_cols, bc]."""
    br, bc = block
    rows, cols = x.shape
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    x = F.pad(x, (0, nc * bc - cols, 0, nr * br - rows))
    return x.view(nr, br, nc, bc)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int], scales: str = "amax") -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (any float dtype; the top-left corner is tile-aligned) ->
    (q [R, C] float8_e4m3fn, scales [ceil(R/br), ceil(C/bc)] float32); `scales` "amax" or "pow2"."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blockwise takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    tiles = _tiled(x.float(), block)
    amax = tiles.abs().amax(dim=(1, 3))
    if scales == "pow2":
        p = _pow2_exponent(amax)
        q = torch.ldexp(tiles, p[:, None, :, None].float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        q = q.view(tiles.shape[0] * block[0], tiles.shape[2] * block[1])[:rows, :cols]
        return q.contiguous(), torch.ldexp(torch.ones_like(amax), (-p).float())
    assert scales == "amax", scales
    # A tensor divisor: CUDA turns division by a Python scalar into multiplication by its
    # reciprocal, which rounds differently; a true division is reproducible by any kernel.
    scales = torch.where(amax > 0, amax / amax.new_full((), FP8_MAX), torch.ones_like(amax))
    q = (tiles / scales[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(tiles.shape[0] * block[0], tiles.shape[2] * block[1])[:rows, :cols]
    return q.contiguous(), scales


def _pow2_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The largest integer p with amax * 2^p <= 448 (0 where amax is 0), clamped to [-127, 127]."""
    fmax_mantissa, fmax_exponent = math.frexp(FP8_MAX)  # 448 = 0.875 * 2^9
    mantissa, exponent = torch.frexp(amax)
    p = fmax_exponent - exponent - (mantissa > fmax_mantissa).to(torch.int32)
    return torch.where(amax > 0, p, torch.zeros_like(p)).clamp(-127, 127)


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(q [R, C] fp8, scales [tile_rows, tile_cols]) -> x [R, C] in `dtype` (fp32 multiply, then cast)."""
    rows, cols = q.shape
    tiles = _tiled(q.float(), block) * scales[:, None, :, None]
    return tiles.view(tiles.shape[0] * block[0], -1)[:rows, :cols].to(dtype)


@dataclass(frozen=True)
class GatheredFP8:
    """What an fp8 all-gather of a BlockShard parameter carried, assembled whole: q [R, C] e4m3 and
    scales [ceil(R/br), ceil(C/bc)] fp32 (the value is q * scale per tile), with the placement's block and
    scale rule. Held from the gather until the parameter is resharded."""

    q: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]
    rule: str


_ATTRIBUTE = "_flexshard_gathered_fp8"


def gathered_fp8(param: torch.Tensor) -> GatheredFP8 | None:
    """The fp8 form of an unsharded parameter (what a module's forward sees between gather and reshard) whose
    placement is `BlockShard(quantize="fp8_e4m3")`, so a consumer can feed e4m3 + scales to an fp8 GEMM
    instead of quantizing the dequantized weight again; None for any other tensor."""
    return getattr(param, _ATTRIBUTE, None)


def attach_gathered_fp8(param: torch.Tensor, gathered: GatheredFP8 | None) -> None:
    setattr(param, _ATTRIBUTE, gathered)
