"""DeepSeek-V3 flavors: a tiny debug model, a 16B (DeepSeek-V2-Lite's dimensions with V3 routing) and the
published 671B."""
from __future__ import annotations

from titan_models.components.moe import MoEConfig
from titan_models.components.rope import YarnRopeScaling
from titan_models.models.deepseek_v3.model import DeepSeekV3Config
from titan_models.registry import PublishedSize

FLAVORS: dict[str, DeepSeekV3Config] = {
    "debug": DeepSeekV3Config(
        vocab_size=2048, dim=256, num_layers=4, num_heads=4, ffn_dim=768, first_k_dense=1,
        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=128, num_shared_experts=1, score_func="sigmoid",
                      n_group=2, topk_group=1, norm_topk_prob=True, route_scale=2.5),
        q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        max_seq_len=2048),
    # DeepSeek-V2-Lite's shapes (15.7B total, 2.4B activated) with DeepSeek-V3's sigmoid routing, so the
    # weights round-trip through DeepseekV3ForCausalLM.
    "16B": DeepSeekV3Config(
        vocab_size=102400, dim=2048, num_layers=27, num_heads=16, ffn_dim=10944, first_k_dense=1,
        moe=MoEConfig(num_experts=64, top_k=6, expert_dim=1408, num_shared_experts=2, score_func="sigmoid",
                      norm_topk_prob=True),
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_scaling=YarnRopeScaling(factor=40.0, original_max_seq_len=4096, mscale=0.707, mscale_all_dim=0.707)),
    "671B": DeepSeekV3Config(
        vocab_size=129280, dim=7168, num_layers=61, num_heads=128, ffn_dim=18432, first_k_dense=3,
        moe=MoEConfig(num_experts=256, top_k=8, expert_dim=2048, num_shared_experts=1, score_func="sigmoid",
                      n_group=8, topk_group=4, norm_topk_prob=True, route_scale=2.5),
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_scaling=YarnRopeScaling(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0),
        mtp=True),
    # Kimi K2.6 / K2.7's text model (Kimi_K25 checkpoints' text_config; Kimi K2's shapes): DeepSeek-V3 with
    # 384 experts, 64 heads, one dense layer, no expert groups, YaRN x32 from 4K to 256K.
    "kimi-k2.6": DeepSeekV3Config(
        vocab_size=163840, dim=7168, num_layers=61, num_heads=64, ffn_dim=18432, first_k_dense=1,
        moe=MoEConfig(num_experts=384, top_k=8, expert_dim=2048, num_shared_experts=1, score_func="sigmoid",
                      n_group=1, topk_group=1, norm_topk_prob=True, route_scale=2.827),
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=50000.0, rope_scaling=YarnRopeScaling(factor=32.0, original_max_seq_len=4096, beta_fast=1.0,
                                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_seq_len=262144),
}

# (total, activated) parameters of the main model (MTP excluded) as published: DeepSeek-V2-Lite's card
# (15.7B / 2.4B), the DeepSeek-V3 report (671B / 37B) and the Kimi K2.6 card (1T / 32B; Kimi K2's
# report: 1.04T total).
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"16B": PublishedSize(total="15.7B", active="2.4B"),
                                              "671B": PublishedSize(total="671B", active="37B"),
                                              "kimi-k2.6": PublishedSize(total="1T", active="32B")}
