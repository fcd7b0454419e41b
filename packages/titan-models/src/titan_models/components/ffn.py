"""SwiGLU feed-forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.projections import project


@dataclass(kw_only=True, frozen=True)
class FeedForwardConfig:
    hidden_dim: int

    def build(self, dim: int) -> "FeedForward":
        return FeedForward(dim, self.hidden_dim)


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.w1, self.w3)
        return self.w2(F.silu(gate) * up)
