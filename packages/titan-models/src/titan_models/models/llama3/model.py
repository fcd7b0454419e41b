"""Llama 3: grouped-query attention, RoPE with Llama 3 frequency scaling, SwiGLU, RMSNorm."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from titan_models.components.attention import AttentionBackend, AttentionConfig
from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.norms import NormConfig, RMSNormConfig
from titan_models.components.rope import Llama3RopeScaling, RopeConfig
from titan_models.model_config import ModelConfigBase
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import GQA_ATTENTION, ParallelPlan, decoder_plan


@dataclass(kw_only=True)
class Llama3Config(ModelConfigBase):
    family: ClassVar[str] = "llama3"

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None  # default dim // num_heads
    norm: NormConfig = field(default_factory=lambda: RMSNormConfig(eps=1e-5))
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_seq_len: int = 131072  # the context the RoPE scaling targets (HF max_position_embeddings)
    tie_embeddings: bool = False
    attention: AttentionBackend = "sdpa"
    dtype: torch.dtype = torch.float32

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.num_heads

    @property
    def qk_head_dim(self) -> int:
        return self.resolved_head_dim

    @property
    def v_head_dim(self) -> int:
        return self.resolved_head_dim

    @property
    def moe(self) -> None:  # every layer is dense
        return None

    def parallel_plan(self) -> ParallelPlan:
        return decoder_plan(num_layers=self.num_layers, attention=GQA_ATTENTION)

    def build(self) -> Transformer:
        head_dim = self.resolved_head_dim
        attention = AttentionConfig(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                    head_dim=head_dim, backend=self.attention)
        ffn = FeedForwardConfig(hidden_dim=self.ffn_dim)
        rope = RopeConfig(dim=head_dim, theta=self.rope_theta, scaling=self.rope_scaling)
        with default_dtype(self.dtype):
            blocks = [
                TransformerBlock(attention=attention.build(self.dim), attention_norm=self.norm.build(self.dim),
                                 ffn_norm=self.norm.build(self.dim), feed_forward=ffn.build(self.dim))
                for _ in range(self.num_layers)
            ]
            return Transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                               norm=self.norm.build(self.dim), rope=rope.build(),
                               tie_embeddings=self.tie_embeddings, parallel_plan=self.parallel_plan())
