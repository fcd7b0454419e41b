"""DeepSeek-V4 flavors: a tiny debug model, V4-Flash (transformers' DeepseekV4Config defaults) and V4-Pro
(the release's config: 7168 wide, 61 layers, 128 heads, 384 experts, 16 output groups, top-1024 indexer)."""
from __future__ import annotations

from titan_models.components.rope import YarnRopeScaling
from titan_models.models.deepseek_v4.model import DeepSeekV4Config, deepseek_v4_moe
from titan_models.registry import PublishedSize

_VOCAB = 129280

FLAVORS: dict[str, DeepSeekV4Config] = {
    "debug": DeepSeekV4Config(
        vocab_size=2048, dim=128, num_layers=4, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=64,
        o_groups=2, o_lora_rank=64, sliding_window=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=4, index_head_dim=32, index_topk=8, mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        moe=deepseek_v4_moe(num_experts=8, top_k=2, expert_dim=64), hc_mult=2, max_seq_len=2048,
        compress_rope_scaling=YarnRopeScaling(factor=4.0, original_max_seq_len=512, explicit_attention_factor=1.0)),
    "Flash": DeepSeekV4Config(
        vocab_size=_VOCAB, dim=4096, num_layers=43, num_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
        o_lora_rank=1024, index_topk=512, moe=deepseek_v4_moe(num_experts=256, top_k=6, expert_dim=2048),
        mtp=True),
    "Pro": DeepSeekV4Config(
        vocab_size=_VOCAB, dim=7168, num_layers=61, num_heads=128, head_dim=512, q_lora_rank=1536, o_groups=16,
        o_lora_rank=1024, index_topk=1024, moe=deepseek_v4_moe(num_experts=384, top_k=6, expert_dim=3072),
        mtp=True),
}

# DeepSeek's model cards: V4-Flash 284B total / 13B activated, V4-Pro 1.6T / 49B (MTP excluded).
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"Flash": PublishedSize(total="284B", active="13B"),
                                              "Pro": PublishedSize(total="1.6T", active="49B")}
