"""Kimi Linear flavors: a tiny debug model and the published Kimi-Linear-48B-A3B.

48B-A3B is the release config.json (transformers 5.20's `KimiLinearConfig` defaults, which name that
checkpoint): hidden 2304, 27 layers (KDA at 1-indexed layers 1-3, 5-7, ..., 25-26; MLA at 4, 8, ..., 24
and 27), 32 KDA heads of 128, MLA with 32 heads (kv_lora_rank 512, no q LoRA, no RoPE), one dense layer
of width 9216, then 256 experts top-8 of width 1024 plus one shared expert, vocabulary 163840.
"""
from __future__ import annotations

from titan_models.components.layer_types import FULL_ATTENTION, LINEAR_ATTENTION
from titan_models.components.moe import MoEConfig
from titan_models.models.kimi_linear.model import KimiLinearConfig
from titan_models.registry import PublishedSize


def kimi_linear_moe(*, experts: int, top_k: int, expert_dim: int) -> MoEConfig:
    """Kimi Linear's MoE (DeepSeek-V3's router): sigmoid scores with the selection bias, renormalised
    top-k scaled by 2.446, one shared expert."""
    return MoEConfig(num_experts=experts, top_k=top_k, expert_dim=expert_dim, num_shared_experts=1,
                     score_func="sigmoid", norm_topk_prob=True, route_scale=2.446)


_FULL_48B = {4, 8, 12, 16, 20, 24, 27}  # 1-indexed, linear_attn_config.full_attn_layers

FLAVORS: dict[str, KimiLinearConfig] = {
    # KDA and MLA alternate so that two layers (transforms.num_layers(2)) keep both; layer 0 dense.
    "debug": KimiLinearConfig(
        vocab_size=2048, dim=256, num_layers=4, num_heads=4, ffn_dim=768, first_k_dense=1,
        moe=kimi_linear_moe(experts=8, top_k=2, expert_dim=128), kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, linear_num_heads=4, linear_head_dim=32,
        layer_types=(LINEAR_ATTENTION, FULL_ATTENTION) * 2, max_seq_len=2048),
    "48B-A3B": KimiLinearConfig(
        vocab_size=163840, dim=2304, num_layers=27, num_heads=32, ffn_dim=9216, first_k_dense=1,
        moe=kimi_linear_moe(experts=256, top_k=8, expert_dim=1024), kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, linear_num_heads=32, linear_head_dim=128,
        layer_types=tuple(FULL_ATTENTION if i + 1 in _FULL_48B else LINEAR_ATTENTION for i in range(27))),
}

# The model card: 48B total, 3B activated.
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"48B-A3B": PublishedSize(total="48B", active="3B")}
