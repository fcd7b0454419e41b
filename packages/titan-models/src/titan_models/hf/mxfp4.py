"""MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 FP4 E2M1 elements sharing one E8M0 scale.

On disk (gpt-oss's published experts): `*_blocks` uint8 [..., G, 16], two E2M1 codes per byte with
element 2i in the low nibble and 2i+1 in the high one, and `*_scales` uint8 [..., G], the shared
exponent with bias 127 (255 encodes NaN). Value = e2m1(code) * 2 ** (scale - 127).
"""
from __future__ import annotations

import torch

BLOCK = 32  # elements sharing one scale


def e2m1_values() -> torch.Tensor:
    """The 16 E2M1 values by code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (m * 0.5)."""
    codes = torch.arange(16)
    sign = 1.0 - 2.0 * (codes >> 3)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).double()
    magnitude = torch.where(exponent == 0, mantissa * 0.5, 2.0 ** (exponent - 1) * (1 + mantissa / 2))
    return sign * magnitude


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
                         f"expected blocks [..., G, {BLOCK // 2}] with scales [..., G]")
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK, dtype=dtype, device=blocks.device)
    if blocks.dim() > 2:  # one leading slice (an expert) at a time bounds the float32 temporaries
        for i in range(blocks.shape[0]):
            out[i] = dequantize_mxfp4(blocks[i], scales[i], dtype=dtype)
        return out
    table = e2m1_values().to(device=blocks.device, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    elements = torch.stack([low, high], dim=-1).flatten(-2)  # [G, 32]: low nibble first
    scale = torch.ldexp(torch.ones(scales.shape, device=blocks.device), scales.to(torch.int32) - 127)
    scale = scale.masked_fill(scales == 255, torch.nan)
    out.copy_((elements * scale[..., None]).flatten(-2))
    return out
