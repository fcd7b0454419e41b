"""Kimi Linear (Moonshot AI, arXiv 2510.26692): a hybrid decoder whose layers are Kimi Delta Attention
(linear attention) or multi-head latent attention without positions, by the per-layer `layer_types`
schedule (the release: 3 KDA then 1 MLA, and MLA last).

Kimi Delta Attention is the Gated DeltaNet component with its three variations switched on: one decay
per key channel (from a low-rank forget-gate projection), a low-rank output gate and a sigmoid-gated
output norm; q, k and v have their own short convs and as many heads as each other. MLA is DeepSeek-V3's
with RoPE off (the shared `qk_rope` key part stays, unrotated): the model carries no positions at all.
Feed-forward: SwiGLU on the `dense` layers (by default the first), DeepSeek-V3's sigmoid-routed MoE
with shared experts on the `sparse` ones.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from titan_models.components.attention import AttentionBackend
from titan_models.components.ffn import FeedForwardConfig
from titan_models.components.gated_deltanet import GatedDeltaNetConfig
from titan_models.components.layer_types import FULL_ATTENTION, LINEAR_ATTENTION, check_layer_types
from titan_models.components.mla import MLAConfig
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import NormConfig, RMSNormConfig
from titan_models.components.rope import RopeConfig
from titan_models.model_config import LatentAttentionHeads, ModelConfigBase
from titan_models.models.transformer import Transformer, TransformerBlock, default_dtype
from titan_models.parallel_plan import GQA_ATTENTION, ParallelPlan, decoder_plan

LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
DENSE, SPARSE = "dense", "sparse"
MLP_LAYER_TYPES = (DENSE, SPARSE)

# Kimi Delta Attention's tensor-parallel styles: heads split with wq/wk/wv (GQA_ATTENTION's names); the
# low-rank gates' down projections are replicated and their up projections split by heads.
KIMI_DELTA_ATTENTION = GQA_ATTENTION | {
    "wb": "colwise", "wz.down": "replicate", "wz.up": "colwise", "wa.down": "replicate", "wa.up": "colwise",
    "q_conv": "headwise", "k_conv": "headwise", "v_conv": "headwise", "decay": "headwise", "norm": "replicate"}


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """transformers' schedule when a config names none: full attention at layers 4, 8, ... (0-indexed)."""
    return tuple(FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(num_layers))


@dataclass(kw_only=True)
class KimiLinearConfig(LatentAttentionHeads, ModelConfigBase):
    family: ClassVar[str] = "kimi_linear"

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int  # MLA heads
    ffn_dim: int  # the dense layers' hidden width
    moe: MoEConfig | None
    first_k_dense: int = 1  # layers 0 .. first_k_dense-1 are dense, unless mlp_layer_types says otherwise
    mlp_layer_types: tuple[str, ...] | None = None  # "dense" / "sparse" per layer
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # unrotated: Kimi Linear's MLA has no RoPE
    v_head_dim: int = 128
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel: int = 4
    linear_chunk_size: int = 64
    layer_types: tuple[str, ...] | None = None  # None: default_layer_types(num_layers)
    norm: NormConfig = field(default_factory=lambda: RMSNormConfig(eps=1e-5))
    max_seq_len: int = 1_048_576
    tie_embeddings: bool = False
    attention: AttentionBackend = "sdpa"
    dtype: torch.dtype = torch.float32

    def layer_kinds(self) -> tuple[str, ...]:
        if self.layer_types is None:
            return default_layer_types(self.num_layers)
        return check_layer_types(self.layer_types, num_layers=self.num_layers, allowed=LAYER_TYPES)

    def mlp_kinds(self) -> tuple[str, ...]:
        if self.mlp_layer_types is None:
            return tuple(DENSE if i < self.first_k_dense else SPARSE for i in range(self.num_layers))
        return check_layer_types(self.mlp_layer_types, num_layers=self.num_layers, allowed=MLP_LAYER_TYPES,
                                 field="mlp_layer_types")

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_kinds()[i] == SPARSE

    def with_num_layers(self, n: int) -> KimiLinearConfig:
        """The first n layers; explicit schedules keep their first n entries."""
        for name in ("layer_types", "mlp_layer_types"):
            schedule = getattr(self, name)
            if schedule is not None and n > len(schedule):
                raise ValueError(f"num_layers({n}) exceeds the {len(schedule)} entries of {name}")
        cut = lambda schedule: None if schedule is None else tuple(schedule[:n])  # noqa: E731
        return dataclasses.replace(self, num_layers=n, first_k_dense=min(self.first_k_dense, n),
                                   layer_types=cut(self.layer_types), mlp_layer_types=cut(self.mlp_layer_types))

    def _validate(self) -> None:
        self.layer_kinds()
        kinds = self.mlp_kinds()
        if SPARSE in kinds and self.moe is None:
            raise ValueError("moe must be set: some layers are sparse (mlp_layer_types / first_k_dense)")
        if DENSE in kinds and self.ffn_dim < 1:
            raise ValueError(f"ffn_dim must be >= 1: some layers are dense, got {self.ffn_dim}")

    def kimi_delta_attention(self) -> GatedDeltaNetConfig:
        return GatedDeltaNetConfig(
            num_key_heads=self.linear_num_heads, num_value_heads=self.linear_num_heads,
            key_head_dim=self.linear_head_dim, value_head_dim=self.linear_head_dim,
            conv_kernel=self.linear_conv_kernel, norm_eps=self.norm.eps, chunk_size=self.linear_chunk_size,
            decay_per_channel=True, gate_rank=self.linear_head_dim, output_gate="sigmoid")

    def mla(self) -> MLAConfig:
        return self.latent_attention(rope=False)  # Kimi Linear's MLA has no RoPE

    def _block(self, i: int, kind: str) -> TransformerBlock:
        mixer = self.kimi_delta_attention() if kind == LINEAR_ATTENTION else self.mla()
        mlp = ({"moe": self.moe.build(self.dim)} if self.is_moe_layer(i)
               else {"feed_forward": FeedForwardConfig(hidden_dim=self.ffn_dim).build(self.dim)})
        return TransformerBlock(attention=mixer.build(self.dim), attention_norm=self.norm.build(self.dim),
                                ffn_norm=self.norm.build(self.dim), **mlp)

    def build(self) -> Transformer:
        self._validate()
        # The blocks take no positions; the Transformer's rope (of the unrotated qk_rope width) goes unused.
        rope = RopeConfig(dim=self.qk_rope_head_dim, theta=10000.0).build()
        with default_dtype(self.dtype):
            blocks = [self._block(i, kind) for i, kind in enumerate(self.layer_kinds())]
            return Transformer(config=self, vocab_size=self.vocab_size, dim=self.dim, blocks=blocks,
                               norm=self.norm.build(self.dim), rope=rope, tie_embeddings=self.tie_embeddings,
                               parallel_plan=self.parallel_plan())

    def parallel_plan(self) -> ParallelPlan:
        """MLA as DeepSeek-V3 splits it; Kimi Delta Attention by heads; FFN/MoE as usual."""
        mla = {"wkv_a": "replicate", "kv_norm": "replicate", "wkv_b": "colwise", "wo": "rowwise"}
        mla |= ({"wq_a": "replicate", "q_norm": "replicate", "wq_b": "colwise"} if self.q_lora_rank
                else {"wq": "colwise"})
        kinds = self.mlp_kinds()
        sparse = SPARSE in kinds
        plan = decoder_plan(num_layers=self.num_layers, attention=KIMI_DELTA_ATTENTION | mla, dense=DENSE in kinds,
                            moe=sparse, shared_experts=sparse and self.moe.num_shared_experts > 0)
        divides = {"num_heads": self.num_heads, "linear_num_heads": self.linear_num_heads}
        return dataclasses.replace(plan, tp_divides=divides)
