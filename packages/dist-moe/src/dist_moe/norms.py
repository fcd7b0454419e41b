"""The two norms of Muse Spark's pooled experts, with titan-models' parameter names and rounding.

    ZeroCenteredRMSNorm   rms_norm(x) * (1 + weight)      on the pooled tokens (pre_expert_norm)
    InputScaledRMSNorm    rms_norm(x * (1 + weight))      on each expert's output (post_expert_norm)

Both keep a zero-centred `weight` (`init_value` 0: a model's init fills it so), compute in float32
(float64 inputs: float64, for the float64 reference tests) and return x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ZeroCenteredRMSNorm(nn.Module):
    init_value = 0.0

    def __init__(self, dim: int, *, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        wide = _wide(x)
        return (F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.to(wide))).to(x.dtype)


class InputScaledRMSNorm(nn.Module):
    init_value = 0.0

    def __init__(self, dim: int, *, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        wide = _wide(x)
        scaled = (x.to(wide) * (1.0 + self.weight.to(wide))).to(x.dtype)  # rounded first, as the reference does
        return F.rms_norm(scaled.to(wide), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _wide(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)
