"""Qwen3.5 dense and MoE: hybrid decoders whose layers are Gated DeltaNet (linear attention) or gated
full attention, by the per-layer `layer_types` schedule (default: 3 linear then 1 full).

Full-attention layers: GQA with a sigmoid output gate from the query projection, zero-centred
`(1 + w)` q/k norms, RoPE on the first `partial_rotary_factor` of each head. Every block norm and
the final norm are zero-centred too. Feed-forward: SwiGLU, or a softmax top-k MoE (always
renormalised) with one shared expert scaled by a sigmoid gate. `HybridConfig` holds what Qwen3-Next
shares (models/qwen3_next differs only in its MoE options and Hugging Face layout).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from titan_models.components.attention import AttentionBackend, AttentionConfig
from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.gated_deltanet import GatedDeltaNetConfig
from titan_models.components.layer_types import FULL_ATTENTION, LINEAR_ATTENTION, check_layer_types, every_nth_full
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import NormConfig, ZeroCenteredRMSNormConfig
from titan_models.components.rope import RopeConfig
from titan_models.model_config import ModelConfigBase
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import GATED_DELTANET, GQA_ATTENTION, QK_NORM, ParallelPlan, decoder_plan

LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


@dataclass(kw_only=True)
class HybridConfig(ModelConfigBase):
    """Fields of the Qwen3-Next / Qwen3.5 decoders. Layer i mixes tokens by `layer_kinds()[i]`; its
    FFN is the MoE when `moe` is set and i is not in `dense_layers` and (i + 1) % moe_every == 0,
    else a SwiGLU of width `ffn_dim`."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 256
    ffn_dim: int = 0  # the dense layers' hidden width (0: no dense layers)
    moe: MoEConfig | None = None
    moe_every: int = 1
    dense_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    linear_chunk_size: int = 64
    layer_types: tuple[str, ...] | None = None  # None: every_nth_full(num_layers, full_attention_interval)
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    norm: NormConfig = field(default_factory=lambda: ZeroCenteredRMSNormConfig(eps=1e-6))
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 262_144
    tie_embeddings: bool = False
    attention: AttentionBackend = "sdpa"
    dtype: torch.dtype = torch.float32

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim

    @property
    def qk_head_dim(self) -> int:  # of the full-attention layers
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    def with_num_layers(self, n: int) -> "HybridConfig":
        """The first n layers; an explicit `layer_types` schedule keeps its first n entries."""
        if self.layer_types is None:
            return dataclasses.replace(self, num_layers=n)
        if n > len(self.layer_types):
            raise ValueError(f"num_layers({n}) exceeds the {len(self.layer_types)} entries of layer_types")
        return dataclasses.replace(self, num_layers=n, layer_types=tuple(self.layer_types[:n]))

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kinds(self) -> tuple[str, ...]:
        if self.layer_types is None:
            return every_nth_full(self.num_layers, self.full_attention_interval)
        return check_layer_types(self.layer_types, num_layers=self.num_layers, allowed=LAYER_TYPES)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i not in self.dense_layers and (i + 1) % self.moe_every == 0

    def _validate(self) -> None:
        self.layer_kinds()
        if self.rope_dim < 2 or self.rope_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} "
                             f"gives {self.rope_dim} rotated channels; it must be a positive even number")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and not self.ffn_dim:
            raise ValueError("ffn_dim must be set: some layers are dense (no moe, or dense_layers / moe_every)")

    def _mixer(self, kind: str):
        if kind == LINEAR_ATTENTION:
            return GatedDeltaNetConfig(
                num_key_heads=self.linear_num_key_heads, num_value_heads=self.linear_num_value_heads,
                key_head_dim=self.linear_key_head_dim, value_head_dim=self.linear_value_head_dim,
                conv_kernel=self.linear_conv_kernel, norm_eps=self.norm.eps, chunk_size=self.linear_chunk_size)
        return AttentionConfig(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                               qk_norm=self.norm, output_gate=True, backend=self.attention)

    def build(self) -> Transformer:
        self._validate()
        kinds = self.layer_kinds()
        with default_dtype(self.dtype):
            blocks = []
            for i, kind in enumerate(kinds):
                ffn = ({"moe": self.moe.build(self.dim)} if self.is_moe_layer(i)
                       else {"feed_forward": FeedForwardConfig(hidden_dim=self.ffn_dim).build(self.dim)})
                blocks.append(TransformerBlock(attention=self._mixer(kind).build(self.dim),
                                               attention_norm=self.norm.build(self.dim),
                                               ffn_norm=self.norm.build(self.dim), **ffn))
            return Transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                               norm=self.norm.build(self.dim),
                               rope=RopeConfig(dim=self.rope_dim, theta=self.rope_theta).build(),
                               tie_embeddings=self.tie_embeddings, parallel_plan=self.parallel_plan())

    def parallel_plan(self) -> ParallelPlan:
        """GQA and Gated DeltaNet split by heads (key heads with their value heads), FFN/MoE as usual."""
        moe_layers = [i for i in range(self.num_layers) if self.is_moe_layer(i)]
        shared = bool(moe_layers) and self.moe.shared_width > 0
        plan = decoder_plan(num_layers=self.num_layers, attention=GQA_ATTENTION | QK_NORM | GATED_DELTANET,
                            dense=len(moe_layers) < self.num_layers, moe=bool(moe_layers), shared_experts=shared)
        tp = dict(plan.tensor_parallel)
        if shared and self.moe.shared_expert_gate:
            tp["layers.*.moe.shared_gate"] = "replicate"
        divides = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                   "linear_num_key_heads": self.linear_num_key_heads,
                   "linear_num_value_heads": self.linear_num_value_heads}
        if self.ffn_dim and len(moe_layers) < self.num_layers:
            divides["ffn_dim"] = self.ffn_dim
        if shared:
            divides["moe.shared_width"] = self.moe.shared_width
        return ParallelPlan(tensor_parallel=tp, experts=plan.experts, moe=plan.moe,
                            pipeline_cut_points=plan.pipeline_cut_points, tp_divides=divides)


@dataclass(kw_only=True)
class Qwen3_5Config(HybridConfig):
    """Qwen3.5 (Hugging Face `qwen3_5_text` / `qwen3_5_moe_text`): dense when `moe` is None, else every
    layer is MoE with `norm_topk_prob=True` and a gated shared expert."""

    family: ClassVar[str] = "qwen3_5"
