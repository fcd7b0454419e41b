"""Muse Spark (text model): Muse Glimmer's decoder (models/muse_glimmer) with learned residual gates
(`residual_gate_temperature`), a scaleless norm of each head's attention output (`o_norm`) before the
gate, a scaleless post-attention norm and an input-scaled post-FFN norm, and MoE layers by
`mlp_layer_types` ("dense" / "sparse"): a sigmoid router with selection bias on the logits times
`output_multiplier`, experts at the pooled width `moe_dim` between `pre_expert_proj` (+ zero-centred
norm) and `post_expert_proj`, each expert's output input-scale normed; no shared expert."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.layer_types import check_layer_types
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import (
    InputScaledRMSNormConfig, ScalelessRMSNormConfig, ZeroCenteredRMSNormConfig,
)
from titan_models.components.residual import ResidualGateConfig
from titan_models.models.muse_glimmer.model import MUSE_ATTENTION, MuseTextConfig
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import ParallelPlan, decoder_plan

MLP_LAYER_TYPES = ("dense", "sparse")


def muse_spark_moe(*, num_experts: int, top_k: int, expert_dim: int, moe_dim: int, output_multiplier: float,
                   rms_norm_eps: float = 1e-5, post_norm_eps: float = 1e-8, route_scale: float = 1.0) -> MoEConfig:
    """Muse Spark's expert layer as a MoEConfig."""
    return MoEConfig(num_experts=num_experts, top_k=top_k, expert_dim=expert_dim, score_func="sigmoid",
                     norm_topk_prob=True, route_scale=route_scale, router_logit_scale=output_multiplier,
                     expert_pool_dim=moe_dim, pre_expert_norm=ZeroCenteredRMSNormConfig(eps=rms_norm_eps),
                     post_expert_norm=InputScaledRMSNormConfig(eps=post_norm_eps))


@dataclass(kw_only=True)
class MuseSparkConfig(MuseTextConfig):
    """`mlp_layer_types[i]` is "sparse" (the MoE) or "dense" (a SwiGLU of width ffn_dim); None: all sparse."""

    family: ClassVar[str] = "muse_spark"

    moe: MoEConfig | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    residual_gate_temperature: float = 0.3
    head_dim: int = 64
    qk_scale_factor: float = 5.4730064863875
    output_multiplier: float = 0.1767766952966369
    rope_theta: float = 500_000.0
    max_seq_len: int = 1_048_576

    def mlp_kinds(self) -> tuple[str, ...]:
        if self.mlp_layer_types is None:
            return ("sparse",) * self.num_layers
        return check_layer_types(self.mlp_layer_types, num_layers=self.num_layers, allowed=MLP_LAYER_TYPES,
                                 field="mlp_layer_types")

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_kinds()[i] == "sparse"

    def with_num_layers(self, n: int) -> "MuseSparkConfig":
        kinds = self.mlp_kinds()[:n]
        return dataclasses.replace(super().with_num_layers(n), mlp_layer_types=kinds)

    def _validate(self) -> None:
        super()._validate()
        kinds = self.mlp_kinds()
        if "sparse" in kinds and self.moe is None:
            raise ValueError("mlp_layer_types has sparse layers but moe is None")
        if "dense" in kinds and self.ffn_dim < 1:
            raise ValueError(f"mlp_layer_types has dense layers; ffn_dim must be positive, got {self.ffn_dim}")

    def _block(self, i: int) -> TransformerBlock:
        gate = ResidualGateConfig(temperature=self.residual_gate_temperature)
        ffn = ({"moe": self.moe.build(self.dim)} if self.is_moe_layer(i)
               else {"feed_forward": FeedForwardConfig(hidden_dim=self.ffn_dim).build(self.dim)})
        output_norm = ScalelessRMSNormConfig(eps=self.rms_norm_eps)
        return TransformerBlock(
            attention=self.attention_config(i, output_norm=output_norm).build(self.dim),
            attention_norm=self.centred_norm().build(self.dim),
            post_attention_norm=ScalelessRMSNormConfig(eps=self.post_norm_eps).build(self.dim),
            attention_residual=gate.build(self.dim), ffn_norm=self.centred_norm().build(self.dim),
            post_ffn_norm=InputScaledRMSNormConfig(eps=self.post_norm_eps).build(self.dim),
            ffn_residual=gate.build(self.dim), **ffn)

    def build(self) -> Transformer:
        self._validate()
        with default_dtype(self.dtype):
            return self.transformer([self._block(i) for i in range(self.num_layers)])

    def parallel_plan(self) -> ParallelPlan:
        """Attention by heads; dense SwiGLU split; the MoE's router, pooling projections and norms whole
        ("replicate"), its routed experts for expert parallelism; residual gates whole."""
        kinds = self.mlp_kinds()
        plan = decoder_plan(num_layers=self.num_layers, attention=MUSE_ATTENTION, dense="dense" in kinds,
                            moe="sparse" in kinds)
        tp = plan.tensor_parallel | {"layers.*.post_ffn_norm": "replicate",
                                     "layers.*.attention_residual": "replicate", "layers.*.ffn_residual": "replicate"}
        if "sparse" in kinds:
            tp |= {"layers.*.moe.pre_expert_proj": "replicate", "layers.*.moe.pre_expert_norm": "replicate",
                   "layers.*.moe.post_expert_norm": "replicate", "layers.*.moe.post_expert_proj": "replicate"}
        return dataclasses.replace(plan, tensor_parallel=tp)
