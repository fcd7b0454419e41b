"""A small transformer-shaped model for the tests: embedding, attention and MLP blocks, norms, head.

Sizes are deliberately awkward (odd vocab, rows not divisible by the rank count, a 1-row
parameter) so uneven shards and ranks with empty shards get exercised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    vocab: int = 37
    dim: int = 24
    hidden: int = 40
    heads: int = 4
    layers: int = 2
    seq: int = 9

    def build(self) -> "TinyTransformer":
        return TinyTransformer(self)


class Block(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.attention_norm = nn.RMSNorm(c.dim)
        self.wqkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=True)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.gate = nn.Parameter(torch.ones(1, c.dim))  # a 1-row parameter: empty shard on rank 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        return x + self.gate * self.w2(F.silu(self.w1(self.ffn_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_model(seed: int = 0, config: TinyConfig | None = None) -> TinyTransformer:
    torch.manual_seed(seed)
    model = (config or TinyConfig()).build()
    with torch.no_grad():  # non-trivial norm weights and gates, so their gradients matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("gate"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(step: int, rows: int, config: TinyConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) for a step: [rows, seq] each."""
    c = config or TinyConfig()
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, c.vocab, (rows, c.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
