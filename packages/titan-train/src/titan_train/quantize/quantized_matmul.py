"""The differentiable quantised matmul of a Linear: its three GEMMs (forward, input and weight gradient) on
operands quantised as the Recipe says, as one autograd.Function."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm import scaled_matmul
from .recipes import Recipe
from .scaling import QuantizedMatrix, quantize, transposed_exponent


@dataclass(frozen=True)
class ScaleGroups:
    """The operands (Recipe field names: x, weight, grad_output, weight_t, grad_output_t, x_t) that are one
    shard of a matrix split over `group` along a dimension their scale blocks span (tensor_parallel.py):
    their block amaxes are max-reduced over the group, so they get the whole matrix's scales."""

    group: object
    operands: frozenset[str]

    def of(self, operand: str):
        return self.group if operand in self.operands else None


class _QuantizedMatmul(torch.autograd.Function):
    """y [M, N] = x [M, K] . W [N, K]^T, with dx = dy . W and dW = dy^T . x, each GEMM on operands quantised
    along its own reduction dimension. Saves x and W as they came (bf16/fp32), not their fp8 forms: the
    backward quantises them along other dimensions. Where an operand's transpose has the transposed blocks
    (tensorwise: x, W and dy; blockwise: W's 128 x 128 blocks) the transpose reuses its exponents (a tensor of
    one per block, saved from the forward for x and W) instead of an amax pass of its own: the same bits.
    weight_data/weight_scale: W already quantised with recipe.weight (flexshard's fp8 all-gather,
    gathered.py), used by the forward in place of quantising W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype,
                backend: str, groups: ScaleGroups | None, weight_data: torch.Tensor | None,
                weight_scale: torch.Tensor | None) -> torch.Tensor:
        ctx.recipe, ctx.backend, ctx.groups = recipe, backend, groups
        if weight_data is None:
            weight_q = _quantize(weight, recipe, "weight", groups)
        else:
            weight_q = QuantizedMatrix(data=weight_data, scale=weight_scale, blocking=recipe.weight,
                                       cols=weight.shape[1])
        x_q = _quantize(x, recipe, "x", groups)
        ctx.save_for_backward(x, weight, _reused_exponent(x_q, recipe, "x", "x_t", groups),
                              _reused_exponent(weight_q, recipe, "weight", "weight_t", groups))
        return scaled_matmul(x_q, weight_q, kernel=recipe.kernel, out_dtype=out_dtype, backend=backend,
                             fast_accum=recipe.forward_fast_accum)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, x_t_exponent, weight_t_exponent = ctx.saved_tensors
        recipe, backend, groups = ctx.recipe, ctx.backend, ctx.groups
        grad_x = grad_w = grad_q = None
        if ctx.needs_input_grad[0]:
            grad_q = _quantize(grad_y, recipe, "grad_output", groups)
            grad_x = scaled_matmul(grad_q, _quantize(weight.t(), recipe, "weight_t", groups, weight_t_exponent),
                                   kernel=recipe.kernel, out_dtype=x.dtype, backend=backend)
        if ctx.needs_input_grad[1]:
            grad_t_exponent = (None if grad_q is None
                               else _reused_exponent(grad_q, recipe, "grad_output", "grad_output_t", groups))
            grad_w = scaled_matmul(_quantize(grad_y.t(), recipe, "grad_output_t", groups, grad_t_exponent),
                                   _quantize(x.t(), recipe, "x_t", groups, x_t_exponent),
                                   kernel=recipe.kernel, out_dtype=weight.dtype, backend=backend)
        return grad_x, grad_w, None, None, None, None, None, None


def _reused_exponent(quantized: QuantizedMatrix, recipe: Recipe, operand: str, operand_t: str,
                     groups: ScaleGroups | None) -> torch.Tensor | None:
    """`operand`'s exponents for its transpose `operand_t`, where they are the transpose's own (scaling.py's
    transposed_exponent) and both are reduced over the same group (or neither is)."""
    if groups is not None and groups.of(operand) is not groups.of(operand_t):
        return None
    return transposed_exponent(quantized, getattr(recipe, operand_t))


def _quantize(matrix: torch.Tensor, recipe: Recipe, operand: str, groups: ScaleGroups | None,
              exponent: torch.Tensor | None = None) -> QuantizedMatrix:
    """exponent: known (a transposed operand's, already reduced over its group where it spans one)."""
    return quantize(matrix, getattr(recipe, operand), amax_group=groups.of(operand) if groups else None,
                    exponent=exponent)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, *, out_dtype: torch.dtype,
                     backend: str = "auto", groups: ScaleGroups | None = None,
                     weight_q: QuantizedMatrix | None = None) -> torch.Tensor:
    """x [..., K] . W [N, K]^T -> [..., N] in out_dtype, through the recipe's GEMMs (differentiable in x and W).
    groups: see ScaleGroups; weight_q: W's forward quantisation, when it was made elsewhere (the fp8 gather)."""
    lead = x.shape[:-1]
    data, scale = (weight_q.data, weight_q.scale) if weight_q is not None else (None, None)
    y = _QuantizedMatmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe, out_dtype, backend, groups, data, scale)
    return y.view(*lead, weight.shape[0])
