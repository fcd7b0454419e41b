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


@dataclass(kw_only=True, frozen=True)
class ZeroCenteredRMSNormConfig:
    """RMSNorm scaled by `(1 + weight)` with the weight stored zero-centred (Gemma, Qwen3-Next, Qwen3.5)."""

    eps: float = 1e-6

    def build(self, dim: int) -> "ZeroCenteredRMSNorm":
        return ZeroCenteredRMSNorm(dim, eps=self.eps)


NormConfig = RMSNormConfig | LayerNormConfig | ZeroCenteredRMSNormConfig


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


class ZeroCenteredRMSNorm(nn.Module):
    """`rms_norm(x) * (1 + weight)`, all in float32 and cast back once (Hugging Face's Gemma3/Qwen3.5
    rounding); a zero weight is the identity scale, so `init_value` is 0."""

    init_value = 0.0

    def __init__(self, dim: int, *, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered"


class GatedRMSNorm(nn.Module):
    """`weight * rms_norm(x) * act(gate)` over the last dim, act = silu (Gated DeltaNet's output norm) or
    sigmoid (Kimi Delta Attention's); plain, not zero-centred, weight. Normed in float32, cast to x's dtype
    before the weight, gated in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"gate activation {activation!r} is not supported; supported: {sorted(_GATE_ACTIVATIONS)}")
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * normed.to(x.dtype)
        return (out * _GATE_ACTIVATIONS[self.activation](gate.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, {self.activation}"


_GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}
