"""Qwen3-Next flavors: tiny debug models and the published Qwen3-Next-80B-A3B.

The 80B-A3B values are transformers 5.20's `Qwen3NextConfig` defaults, which its docstring names
the Qwen3-Next-80B-A3B configuration (hidden 2048, 48 layers, 3 Gated DeltaNet : 1 gated attention,
512 experts top-10 of width 512 plus a 512-wide gated shared expert), with the released rope_theta.
"""
from __future__ import annotations

from titan_models.components.layer_types import FULL_ATTENTION, LINEAR_ATTENTION
from titan_models.components.moe import MoEConfig
from titan_models.models.qwen3_next.model import Qwen3NextConfig
from titan_models.registry import PublishedSize


def qwen3_next_moe(*, experts: int, top_k: int, expert_dim: int, shared_dim: int, norm_topk_prob: bool = True
                   ) -> MoEConfig:
    return MoEConfig(num_experts=experts, top_k=top_k, expert_dim=expert_dim, score_func="softmax",
                     norm_topk_prob=norm_topk_prob, shared_expert_dim=shared_dim, shared_expert_gate=True)


_DEBUG = dict(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              layer_types=(LINEAR_ATTENTION, FULL_ATTENTION) * 2, max_seq_len=2048, ffn_dim=768)

FLAVORS: dict[str, Qwen3NextConfig] = {
    "debug": Qwen3NextConfig(moe=qwen3_next_moe(experts=8, top_k=2, expert_dim=128, shared_dim=128), **_DEBUG),
    "80B-A3B": Qwen3NextConfig(vocab_size=151936, dim=2048, num_layers=48, num_heads=16, num_kv_heads=2,
                               head_dim=256, ffn_dim=5632,
                               moe=qwen3_next_moe(experts=512, top_k=10, expert_dim=512, shared_dim=512)),
}

PUBLISHED_PARAMS: dict[str, PublishedSize] = {"80B-A3B": PublishedSize(total="80B", active="3B")}
