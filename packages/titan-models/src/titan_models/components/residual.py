"""Learned residual connections (Muse Spark): out = alpha * residual + beta * branch per channel."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(kw_only=True, frozen=True)
class ResidualGateConfig:
    """beta = sigmoid(g / temperature), alpha = sqrt(max(sigmoid(-g / temperature) * (1 + beta), eps)):
    a per-channel blend that keeps the residual stream's scale roughly constant."""

    temperature: float = 0.3
    eps: float = 1e-3

    def build(self, dim: int) -> "ResidualGate":
        if self.temperature <= 0:
            raise ValueError(f"residual_gate_temperature must be positive, got {self.temperature}")
        return ResidualGate(dim, temperature=self.temperature, eps=self.eps)


class ResidualGate(nn.Module):
    """gate(residual, branch) -> the blended stream, computed in float32 and cast to the residual's dtype."""

    def __init__(self, dim: int, *, temperature: float, eps: float):
        super().__init__()
        self.temperature, self.eps = temperature, eps
        self.gate = nn.Parameter(torch.empty(dim))

    def forward(self, residual: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        w = self.gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=self.eps))
        return (alpha * residual.float() + beta * branch.float()).to(residual.dtype)

    def extra_repr(self) -> str:
        return f"{self.gate.shape[0]}, temperature={self.temperature}"
