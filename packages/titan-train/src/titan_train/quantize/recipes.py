"""The low-precision recipes of quantize.linear: how each operand of a Linear's three GEMMs is quantised.

A Linear y = x W^T (x [M, K] tokens x in, W [N, K] out x in) runs three GEMMs, each handed its operands
with the reduction dimension last (scaling.py):
    forward      y  [M, N] = x   [M, K] . W   [N, K]   reduce over K (in_features)
    input grad   dx [M, K] = dy  [M, N] . W^T [K, N]   reduce over N (out_features)
    weight grad  dW [N, K] = dy^T[N, M] . x^T [K, M]   reduce over M (tokens)
Each operand is quantised from its bf16/fp32 value along its own GEMM's reduction dimension (a scale per
row or block must not straddle the summed index, or it cannot be taken out of the sum); nothing fp8 is
kept between the forward and the backward, so every recipe saves the same bf16 activations as a bf16 Linear.

Gradient format, per recipe:
  fp8_tensorwise: dy in e5m2 (5 exponent bits, 2 mantissa), x and W in e4m3. One scale for a whole gradient
      tensor must cover its full dynamic range, which for gradients spans far more binades than e4m3's
      (2^-9 .. 448); e5m2 trades a mantissa bit for that range (NVIDIA Transformer Engine's "hybrid" format,
      torchao's tensorwise default). torch._scaled_mm takes e5m2 x e4m3.
  fp8_rowwise, fp8_blockwise, mxfp8: every operand e4m3, gradients included. With a scale per row, 128-block
      or 32-block the range a scale must cover is local, and e4m3's extra mantissa bit is worth more than
      e5m2's range (DeepSeek-V3 section 3.3.2 uses e4m3 for all tensors for this reason; torchao's rowwise
      recipe does the same).
  fp8_blockwise (DeepSeek-V3): activations and gradients in 1 x 128 tiles along the reduction, weights in
      128 x 128 blocks (the same blocks serve W and W^T); the weight gradient reduces over tokens, so both of
      its operands (dy^T and x^T) are cut in 1 x 128 tiles along the token dimension.
  mxfp8: OCP MX v1.0, 1 x 32 blocks along every reduction with e8m0 (power-of-two) scales by the spec's rule.
"""
from __future__ import annotations

from dataclasses import dataclass

from .scaling import E4M3, E5M2, Blocking

# torch._scaled_mm wants the reduction and output dimensions in multiples of 16.
_SCALED_MM_ALIGN = 16


@dataclass(frozen=True)
class Recipe:
    """The blocking of the six operands of a Linear's GEMMs, and the granularity its weights need."""

    name: str
    x: Blocking
    """x [M, K] in the forward."""
    weight: Blocking
    """W [N, K] in the forward."""
    grad_output: Blocking
    """dy [M, N] in the input gradient."""
    weight_t: Blocking
    """W^T [K, N] in the input gradient."""
    grad_output_t: Blocking
    """dy^T [N, M] in the weight gradient."""
    x_t: Blocking
    """x^T [K, M] in the weight gradient."""
    kernel: str
    """scaled_mm (tensorwise/rowwise scales), blockwise (the Triton per-block GEMM), mx."""
    weight_multiple: int
    """in_features and out_features must be multiples of this (they are the forward's and the input
    gradient's reduction dimensions, and rows of weight blocks); the token dimension is zero-padded instead."""
    forward_fast_accum: bool = False
    """scaled_mm kernels: the forward GEMM with torch._scaled_mm's use_fast_accum (on Hopper the tensor cores'
    own accumulator over the whole reduction, no periodic promotion to fp32: faster, less accurate; torchao's
    default for its output GEMM). The backward's GEMMs, whose sums feed the weights, always promote."""


def _amax(rows: int, cols: int, dtype=E4M3, pad: int = _SCALED_MM_ALIGN) -> Blocking:
    return Blocking(rows=rows, cols=cols, dtype=dtype, pad_cols=pad)


_TENSORWISE = Recipe("fp8_tensorwise", x=_amax(0, 0), weight=_amax(0, 0), grad_output=_amax(0, 0, E5M2),
                     weight_t=_amax(0, 0), grad_output_t=_amax(0, 0, E5M2), x_t=_amax(0, 0),
                     kernel="scaled_mm", weight_multiple=_SCALED_MM_ALIGN)
_ROWWISE = Recipe("fp8_rowwise", x=_amax(1, 0), weight=_amax(1, 0), grad_output=_amax(1, 0), weight_t=_amax(1, 0),
                  grad_output_t=_amax(1, 0), x_t=_amax(1, 0), kernel="scaled_mm", weight_multiple=_SCALED_MM_ALIGN)
_TILE, _BLOCK = _amax(1, 128, pad=128), _amax(128, 128, pad=128)
_BLOCKWISE = Recipe("fp8_blockwise", x=_TILE, weight=_BLOCK, grad_output=_TILE, weight_t=_BLOCK, grad_output_t=_TILE,
                    x_t=_TILE, kernel="blockwise", weight_multiple=128)
_MX = Blocking(rows=1, cols=32, dtype=E4M3, rule="mx", pad_cols=32)
_MXFP8 = Recipe("mxfp8", x=_MX, weight=_MX, grad_output=_MX, weight_t=_MX, grad_output_t=_MX, x_t=_MX, kernel="mx",
                weight_multiple=32)

RECIPES: dict[str, Recipe] = {r.name: r for r in (_TENSORWISE, _ROWWISE, _BLOCKWISE, _MXFP8)}


def blockable(recipe: Recipe, in_features: int, out_features: int) -> bool:
    """Whether a Linear of this shape can run the recipe (both feature dimensions cut into whole blocks)."""
    return in_features % recipe.weight_multiple == 0 and out_features % recipe.weight_multiple == 0
