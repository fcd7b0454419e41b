"""Qwen3 dense and MoE: GQA with per-head QK RMSNorm, SwiGLU or softmax top-k MoE, RMSNorm."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from titan_models.components.attention import AttentionBackend, AttentionConfig
from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import NormConfig, RMSNormConfig
from titan_models.components.rope import RopeConfig
from titan_models.model_config import ModelConfigBase, SharedHeadDim
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import GQA_ATTENTION, QK_NORM, ParallelPlan, decoder_plan


@dataclass(kw_only=True)
class Qwen3Config(SharedHeadDim, ModelConfigBase):
    """Dense when `moe` is None. With `moe`, layer i is a MoE layer unless i is in `dense_layers`
    or (i + 1) is not a multiple of `moe_every` (HF's mlp_only_layers / decoder_sparse_step)."""

    family: ClassVar[str] = "qwen3"

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    ffn_dim: int  # dense layers' hidden width
    moe: MoEConfig | None = None
    moe_every: int = 1
    dense_layers: tuple[int, ...] = ()
    norm: NormConfig = field(default_factory=lambda: RMSNormConfig(eps=1e-6))
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    attention: AttentionBackend = "sdpa"
    dtype: torch.dtype = torch.float32

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i not in self.dense_layers and (i + 1) % self.moe_every == 0

    def parallel_plan(self) -> ParallelPlan:
        moe_layers = [i for i in range(self.num_layers) if self.is_moe_layer(i)]
        return decoder_plan(num_layers=self.num_layers, attention=GQA_ATTENTION | QK_NORM,
                            dense=len(moe_layers) < self.num_layers, moe=bool(moe_layers),
                            shared_experts=bool(moe_layers) and self.moe.num_shared_experts > 0)

    def build(self) -> Transformer:
        rope = RopeConfig(dim=self.head_dim, theta=self.rope_theta)
        with default_dtype(self.dtype):
            return Transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=self.build_blocks(),
                               norm=self.norm.build(self.dim), rope=rope.build(),
                               tie_embeddings=self.tie_embeddings, parallel_plan=self.parallel_plan())

    def build_blocks(self) -> list[TransformerBlock]:
        """The decoder blocks (Qwen3-VL builds its text model from the same blocks)."""
        attention = AttentionConfig(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, qk_norm=self.norm, backend=self.attention)
        ffn = FeedForwardConfig(hidden_dim=self.ffn_dim)
        blocks = []
        for i in range(self.num_layers):
            mlp = {"moe": self.moe.build(self.dim)} if self.is_moe_layer(i) else {"feed_forward": ffn.build(self.dim)}
            blocks.append(TransformerBlock(attention=attention.build(self.dim), attention_norm=self.norm.build(self.dim),
                                           ffn_norm=self.norm.build(self.dim), **mlp))
        return blocks
