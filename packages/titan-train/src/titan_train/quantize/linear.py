"""QuantizedLinear: an nn.Linear (the same weight and bias Parameters, so the same checkpoint entries) whose
three GEMMs run in low precision as its Recipe says (recipes.py); master weights and gradients keep the
parameters' dtype (bf16 or fp32), and the output is in the compute dtype (autocast's, else the input's).
A weight that tensor parallelism made a DTensor runs through tensor_parallel.py; one that flexshard gathered
as fp8 in the recipe's own blocks feeds the forward GEMM as gathered (gathered.py)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .gathered import gathered_weight
from .quantized_matmul import ScaleGroups, quantized_linear
from .recipes import Recipe
from .tensor_parallel import sharded_quantized_linear

__all__ = ["QuantizedLinear", "ScaleGroups", "quantized_linear"]


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
            if isinstance(self.weight, DTensor):
                return sharded_quantized_linear(x, self.weight, self.bias, self.recipe, out_dtype=out_dtype,
                                                backend=self.backend)
            y = quantized_linear(x, self.weight, self.recipe, out_dtype=out_dtype, backend=self.backend,
                                 weight_q=gathered_weight(self.weight, self.recipe))
            return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"

