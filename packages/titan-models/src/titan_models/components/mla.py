"""Multi-head latent attention (DeepSeek-V2/V3).

Queries come from x directly (`wq`) or through a low-rank bottleneck (`wq_a` -> `q_norm` -> `wq_b`).
Keys and values come from a compressed latent: `wkv_a` maps x to [kv_lora_rank latent | a single
shared rope key], the latent is normed (`kv_norm`) and expanded by `wkv_b` into per-head
[k_nope | v]. Each head's key is [k_nope | shared rope key]; only the rope part carries position
("decoupled RoPE"). The inner attention sees q/k of qk_nope + qk_rope dims and v of v_head_dim.
With `rope=False` (Kimi Linear's MLA) nothing is rotated: the shared key part stays, position-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from titan_models.components.attention import AttentionBackend, build_inner_attention
from titan_models.components.norms import NormConfig, RMSNormConfig
from titan_models.components.rope import apply_rotary
from titan_models.context import AttentionContext


@dataclass(kw_only=True, frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None: a full-rank `wq`
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm: NormConfig = field(default_factory=lambda: RMSNormConfig(eps=1e-6))
    rope_interleave: bool = False  # DeepSeek's original checkpoints rotate interleaved pairs
    softmax_scale_factor: float = 1.0  # YaRN's mscale**2 (1 without YaRN)
    rope: bool = True  # False: no position at all (the qk_rope dims are kept, unrotated)
    backend: AttentionBackend = "sdpa"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def build(self, dim: int) -> "MultiHeadLatentAttention":
        return MultiHeadLatentAttention(dim, self)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, dim: int, config: MLAConfig):
        super().__init__()
        self.config = config
        heads, qk_dim = config.num_heads, config.qk_head_dim
        self.score_dims = (heads, qk_dim, config.v_head_dim)  # for FLOP counting
        if config.q_lora_rank:
            self.wq_a = nn.Linear(dim, config.q_lora_rank, bias=False)
            self.q_norm = config.latent_norm.build(config.q_lora_rank)
            self.wq_b = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_norm = config.latent_norm.build(config.kv_lora_rank)
        self.wkv_b = nn.Linear(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * config.v_head_dim, dim, bias=False)
        self.inner = build_inner_attention(config.backend, scale=qk_dim**-0.5 * config.softmax_scale_factor)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *,
                context: AttentionContext | None = None) -> torch.Tensor:
        cfg = self.config
        batch, seq, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        q = q.view(batch, seq, -1, cfg.qk_head_dim)  # [b, s, heads, nope + rope]
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)  # [b, s, 1, rope]: one rope key shared by all heads
        if cfg.rope:
            cos, sin = rope
            q_rope = apply_rotary(q_rope, cos, sin, interleaved=cfg.rope_interleave)
            k_rope = apply_rotary(k_rope, cos, sin, interleaved=cfg.rope_interleave)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = self.inner(q, k, v, context=context)  # [b, s, heads, v_head_dim]
        return self.wo(out.reshape(batch, seq, -1))
