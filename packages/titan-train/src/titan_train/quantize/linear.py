"""QuantizedLinear: an nn.Linear (the same weight and bias Parameters, so the same checkpoint entries) whose
three GEMMs run in low precision as its Recipe says (recipes.py); master weights and gradients keep the
parameters' dtype (bf16 or fp32), and the output is in the compute dtype (autocast's, else the input's)."""
from __future__ import annotations

import torch
from torch import nn

from .gemm import scaled_matmul
from .recipes import Recipe
from .scaling import quantize


class _QuantizedMatmul(torch.autograd.Function):
    """y [M, N] = x [M, K] . W [N, K]^T, with dx = dy . W and dW = dy^T . x, each GEMM on operands quantised
    along its own reduction dimension. Saves x and W as they came (bf16/fp32), not their fp8 forms: the
    backward quantises them along other dimensions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype,
                backend: str) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.out_dtype, ctx.backend = recipe, out_dtype, backend
        return scaled_matmul(quantize(x, recipe.x), quantize(weight, recipe.weight), kernel=recipe.kernel,
                             out_dtype=out_dtype, backend=backend)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, backend = ctx.recipe, ctx.backend
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_matmul(quantize(grad_y, recipe.grad_output), quantize(weight.t(), recipe.weight_t),
                                   kernel=recipe.kernel, out_dtype=x.dtype, backend=backend)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_matmul(quantize(grad_y.t(), recipe.grad_output_t), quantize(x.t(), recipe.x_t),
                                   kernel=recipe.kernel, out_dtype=weight.dtype, backend=backend)
        return grad_x, grad_w, None, None, None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, *, out_dtype: torch.dtype,
                     backend: str = "auto") -> torch.Tensor:
    """x [..., K] . W [N, K]^T -> [..., N] in out_dtype, through the recipe's GEMMs (differentiable in x and W)."""
    lead = x.shape[:-1]
    y = _QuantizedMatmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe, out_dtype, backend)
    return y.view(*lead, weight.shape[0])


class QuantizedLinear(nn.Linear):
    """An nn.Linear whose matmul runs through `recipe`; `backend` auto (GPU kernels on CUDA, emulated on CPU)
    or emulated (quantise -> dequantise -> fp32 matmul everywhere)."""

    def __init__(self, base: nn.Linear, *, recipe: Recipe, backend: str = "auto"):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.recipe, self.backend = recipe, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):  # the GEMMs choose their own precision
            y = quantized_linear(x, self.weight, self.recipe, out_dtype=out_dtype, backend=self.backend)
            return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"

