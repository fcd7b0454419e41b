"""Blockwise fp8 (e4m3) quantization: one fp32 scale per (rows, cols) tile.

scale = amax(|tile|) / 448 (1 for an all-zero tile), q = fp8(clamp(x / scale, -448, 448)).
Every step is elementwise or a max within one tile, so quantizing a tile-aligned piece gives
exactly the bits that quantizing the whole matrix gives for that piece: a rank can quantize its own
tiles and the gathered result equals gather-then-quantize bit for bit.
"""
from __future__ import annotations

import math

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


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (any float dtype; the top-left corner is tile-aligned) ->
    (q [R, C] float8_e4m3fn, scales [ceil(R/br), ceil(C/bc)] float32)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blockwise takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    tiles = _tiled(x.float(), block)
    amax = tiles.abs().amax(dim=(1, 3))
    # A tensor divisor: CUDA turns division by a Python scalar into multiplication by its
    # reciprocal, which rounds differently; a true division is reproducible by any kernel.
    scales = torch.where(amax > 0, amax / amax.new_full((), FP8_MAX), torch.ones_like(amax))
    q = (tiles / scales[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(tiles.shape[0] * block[0], tiles.shape[2] * block[1])[:rows, :cols]
    return q.contiguous(), scales


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(q [R, C] fp8, scales [tile_rows, tile_cols]) -> x [R, C] in `dtype` (fp32 multiply, then cast)."""
    rows, cols = q.shape
    tiles = _tiled(q.float(), block) * scales[:, None, :, None]
    return tiles.view(tiles.shape[0] * block[0], -1)[:rows, :cols].to(dtype)
