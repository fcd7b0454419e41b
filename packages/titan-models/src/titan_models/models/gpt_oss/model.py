"""gpt-oss: GQA with q/k/v/o biases and per-head attention sinks, sliding-window layers
alternating with full ones (`layer_types`), a MoE in every layer (router with bias, softmax over
the top-k logits, clamped SwiGLU experts with biases), YaRN RoPE, RMSNorm."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from titan_models.components.attention import AttentionBackend, AttentionConfig
from titan_models.components.ffn import ClampedSwiGLU
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import NormConfig, RMSNormConfig
from titan_models.components.rope import RopeConfig, YarnRopeScaling
from titan_models.model_config import ModelConfigBase, SharedHeadDim
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import GQA_ATTENTION, ParallelPlan, decoder_plan

LAYER_TYPES: tuple[str, ...] = ("sliding_attention", "full_attention")


def gpt_oss_moe(*, num_experts: int, top_k: int, expert_dim: int, swiglu_limit: float = 7.0,
                swiglu_alpha: float = 1.702) -> MoEConfig:
    """gpt-oss's expert layer: top-k of the biased router logits, softmax over those k."""
    return MoEConfig(num_experts=num_experts, top_k=top_k, expert_dim=expert_dim, score_func="topk_softmax",
                     router_bias=True, expert_linear_bias=True,
                     activation=ClampedSwiGLU(limit=swiglu_limit, alpha=swiglu_alpha, up_shift=1.0))


def _default_yarn() -> YarnRopeScaling:
    # the published checkpoints: 4k pretraining context stretched 32x, ramp bounds not rounded
    return YarnRopeScaling(factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)


@dataclass(kw_only=True)
class GptOssConfig(SharedHeadDim, ModelConfigBase):
    """`layer_types[i]` is "sliding_attention" (the last `sliding_window` keys) or "full_attention";
    None means alternating, sliding first (Hugging Face's default)."""

    family: ClassVar[str] = "gpt_oss"

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 64
    moe: MoEConfig
    layer_types: tuple[str, ...] | None = None
    sliding_window: int = 128
    norm: NormConfig = field(default_factory=lambda: RMSNormConfig(eps=1e-5))
    rope_theta: float = 150000.0
    rope_scaling: YarnRopeScaling | None = field(default_factory=_default_yarn)
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    attention: AttentionBackend = "flex"  # sinks run in flex_attention; "sdpa" runs them eagerly
    dtype: torch.dtype = torch.float32

    @property
    def ffn_dim(self) -> int:
        """No dense layers: the experts' hidden width, the FFN width a plan would split."""
        return self.moe.expert_dim

    def with_num_layers(self, n: int) -> "GptOssConfig":
        """The first n layers, their sliding/full schedule included."""
        types = None if self.layer_types is None else tuple(self.layer_types[:n])
        return dataclasses.replace(self, num_layers=n, layer_types=types)

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        if self.layer_types is None:
            return tuple(LAYER_TYPES[i % 2] for i in range(self.num_layers))
        return tuple(self.layer_types)

    def _validate(self) -> None:
        types = self.resolved_layer_types
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries; num_layers={self.num_layers} needs one per layer")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types holds unknown entries {unknown}; allowed: {list(LAYER_TYPES)}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def attention_config(self, layer_type: str) -> AttentionConfig:
        window = self.sliding_window if layer_type == "sliding_attention" else None
        return AttentionConfig(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                               backend=self.attention, bias=True, sinks=True, sliding_window=window)

    def build(self) -> Transformer:
        self._validate()
        rope = RopeConfig(dim=self.head_dim, theta=self.rope_theta, scaling=self.rope_scaling)
        with default_dtype(self.dtype):
            blocks = [TransformerBlock(attention=self.attention_config(kind).build(self.dim),
                                       attention_norm=self.norm.build(self.dim), ffn_norm=self.norm.build(self.dim),
                                       moe=self.moe.build(self.dim))
                      for kind in self.resolved_layer_types]
            return Transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                               norm=self.norm.build(self.dim), rope=rope.build(),
                               tie_embeddings=self.tie_embeddings, parallel_plan=self.parallel_plan())

    def parallel_plan(self) -> ParallelPlan:
        """Heads colwise with their sinks ("headwise": sharded on dim 0 like q's rows), o rowwise,
        the router whole, routed experts for expert parallelism; a cut point before every layer."""
        return decoder_plan(num_layers=self.num_layers, attention=GQA_ATTENTION | {"sinks": "headwise"},
                            dense=False, moe=True)
