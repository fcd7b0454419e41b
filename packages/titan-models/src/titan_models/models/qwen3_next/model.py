"""Qwen3-Next: the hybrid decoder of Qwen3.5 (Gated DeltaNet and gated attention layers by
`layer_types`, zero-centred norms, partial RoPE; see models/qwen3_5/model.py) with Qwen2-MoE-style
layers: MoE where `dense_layers` / `moe_every` allow (HF's mlp_only_layers / decoder_sparse_step),
`norm_topk_prob` as configured, and a sigmoid-gated shared expert."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titan_models.models.qwen3_5.model import HybridConfig


@dataclass(kw_only=True)
class Qwen3NextConfig(HybridConfig):
    family: ClassVar[str] = "qwen3_next"
