"""SwiGLU feed-forward, and the clamped SwiGLU gpt-oss's experts use."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.projections import project


@dataclass(kw_only=True, frozen=True)
class ClampedSwiGLU:
    """(clamp(up, -limit, limit) + up_shift) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).

    gpt-oss's defaults (limit 7, alpha 1.702, shift 1); the clamps bound the activations of
    low-precision training. alpha=1, up_shift=0 is a clamped plain SwiGLU (silu(g) * up).
    """

    limit: float = 7.0
    alpha: float = 1.702
    up_shift: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + self.up_shift) * (gate * torch.sigmoid(gate * self.alpha))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(kw_only=True, frozen=True)
class FeedForwardConfig:
    hidden_dim: int

    def build(self, dim: int) -> "FeedForward":
        return FeedForward(dim, self.hidden_dim)


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int, *, activation: ClampedSwiGLU | None = None):
        super().__init__()
        self.activation = activation or swiglu  # DeepSeek-V4's shared expert: a clamped SwiGLU
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.w1, self.w3)
        return self.w2(self.activation(gate, up))
