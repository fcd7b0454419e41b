"""Qwen3.5 flavors: tiny debug models (dense and MoE) and the published Qwen3.5-35B-A3B and -397B-A17B.

The 35B-A3B values are transformers 5.20's `Qwen3_5MoeTextConfig` defaults, which its docstring
names the Qwen3.5-35B-A3B configuration (hidden 2048, 40 layers, 3 Gated DeltaNet : 1 gated
attention, 256 experts top-8 of width 512 plus a 512-wide gated shared expert). The 397B-A17B values
are its model card's architecture table (hidden 4096, 60 layers, 32 q / 2 kv heads of 256, linear
attention 16 qk / 64 v heads of 128, 512 experts top-10 of width 1024 plus a shared expert).
Published sizes count the whole vision-language checkpoint; the text model is ~0.5B below them.
"""
from __future__ import annotations

from titan_models.components.layer_types import FULL_ATTENTION, LINEAR_ATTENTION
from titan_models.components.moe import MoEConfig
from titan_models.models.qwen3_5.model import Qwen3_5Config
from titan_models.registry import PublishedSize

_VOCAB = 248320


def qwen3_5_moe(*, experts: int, top_k: int, expert_dim: int, shared_dim: int) -> MoEConfig:
    """Qwen3.5's MoE: softmax over all experts, top-k always renormalised, one sigmoid-gated shared expert."""
    return MoEConfig(num_experts=experts, top_k=top_k, expert_dim=expert_dim, score_func="softmax",
                     norm_topk_prob=True, shared_expert_dim=shared_dim, shared_expert_gate=True)


# Debug models alternate linear and full attention so that two layers (transforms.num_layers(2)) keep both.
_DEBUG_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION) * 2
_DEBUG = dict(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              layer_types=_DEBUG_TYPES, max_seq_len=2048)

FLAVORS: dict[str, Qwen3_5Config] = {
    "debug": Qwen3_5Config(ffn_dim=768, **_DEBUG),
    "debug_moe": Qwen3_5Config(moe=qwen3_5_moe(experts=8, top_k=2, expert_dim=128, shared_dim=128), **_DEBUG),
    "35B-A3B": Qwen3_5Config(vocab_size=_VOCAB, dim=2048, num_layers=40, num_heads=16, num_kv_heads=2, head_dim=256,
                             moe=qwen3_5_moe(experts=256, top_k=8, expert_dim=512, shared_dim=512)),
    "397B-A17B": Qwen3_5Config(vocab_size=_VOCAB, dim=4096, num_layers=60, num_heads=32, num_kv_heads=2,
                               head_dim=256, linear_num_value_heads=64,
                               moe=qwen3_5_moe(experts=512, top_k=10, expert_dim=1024, shared_dim=1024)),
}

PUBLISHED_PARAMS: dict[str, PublishedSize] = {"35B-A3B": PublishedSize(total="35B", active="3B"),
                                              "397B-A17B": PublishedSize(total="397B", active="17B")}
