"""The differentiable quantised matmul of a Linear: its three GEMMs (forward, input and weight gradient) on
operands quantised as the Recipe says, as one autograd.Function."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm import scaled_matmul
from .recipes import Recipe
from .scaling import QuantizedMatrix, quantize


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
    backward quantises them along other dimensions. weight_data/weight_scale: W already quantised with
    recipe.weight (flexshard's fp8 all-gather, gathered.py), used by the forward in place of quantising W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype,
                backend: str, groups: ScaleGroups | None, weight_data: torch.Tensor | None,
                weight_scale: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.backend, ctx.groups = recipe, backend, groups
        if weight_data is None:
            weight_q = _quantize(weight, recipe, "weight", groups)
        else:
            weight_q = QuantizedMatrix(data=weight_data, scale=weight_scale, blocking=recipe.weight,
                                       cols=weight.shape[1])
        return scaled_matmul(_quantize(x, recipe, "x", groups), weight_q, kernel=recipe.kernel,
                             out_dtype=out_dtype, backend=backend)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, backend, groups = ctx.recipe, ctx.backend, ctx.groups
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_matmul(_quantize(grad_y, recipe, "grad_output", groups),
                                   _quantize(weight.t(), recipe, "weight_t", groups),
                                   kernel=recipe.kernel, out_dtype=x.dtype, backend=backend)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_matmul(_quantize(grad_y.t(), recipe, "grad_output_t", groups),
                                   _quantize(x.t(), recipe, "x_t", groups),
                                   kernel=recipe.kernel, out_dtype=weight.dtype, backend=backend)
        return grad_x, grad_w, None, None, None, None, None, None


def _quantize(matrix: torch.Tensor, recipe: Recipe, operand: str, groups: ScaleGroups | None) -> QuantizedMatrix:
    return quantize(matrix, getattr(recipe, operand), amax_group=groups.of(operand) if groups else None)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, *, out_dtype: torch.dtype,
                     backend: str = "auto", groups: ScaleGroups | None = None,
                     weight_q: QuantizedMatrix | None = None) -> torch.Tensor:
    """x [..., K] . W [N, K]^T -> [..., N] in out_dtype, through the recipe's GEMMs (differentiable in x and W).
    groups: see ScaleGroups; weight_q: W's forward quantisation, when it was made elsewhere (the fp8 gather)."""
    lead = x.shape[:-1]
    data, scale = (weight_q.data, weight_q.scale) if weight_q is not None else (None, None)
    y = _QuantizedMatmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe, out_dtype, backend, groups, data, scale)
    return y.view(*lead, weight.shape[0])
