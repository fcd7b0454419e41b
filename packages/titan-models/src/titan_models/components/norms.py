"""Normalisation layers and their configs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class RMSNormConfig:
    eps: float = 1e-6

    def build(self, dim: int) -> "RMSNorm":
        return RMSNorm(dim, eps=self.eps)


@dataclass(kw_only=True, frozen=True)
class LayerNormConfig:
    eps: float = 1e-5

    def build(self, dim: int) -> nn.LayerNorm:
        return nn.LayerNorm(dim, eps=self.eps)


NormConfig = RMSNormConfig | LayerNormConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does, so
    bf16 runs round at the same place as the reference. The output keeps the input's dtype: with
    bf16 activations and an fp32 master weight (autocast) it stays bf16, which is what the next
    matmul would cast it to anyway."""

    def __init__(self, dim: int, *, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight * normed.to(x.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
