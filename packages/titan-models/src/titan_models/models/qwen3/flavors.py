"""Qwen3 flavors: tiny debug models (dense and MoE) and the published Qwen3 sizes."""
from __future__ import annotations

from titan_models.components.moe import MoEConfig
from titan_models.models.qwen3.model import Qwen3Config
from titan_models.registry import PublishedSize

_VOCAB = 151936


def _moe(*, experts: int, top_k: int, expert_dim: int) -> MoEConfig:
    # Qwen3-MoE: softmax over all experts, top-8 renormalised, no shared experts.
    return MoEConfig(num_experts=experts, top_k=top_k, expert_dim=expert_dim, score_func="softmax",
                     norm_topk_prob=True)


FLAVORS: dict[str, Qwen3Config] = {
    "debug": Qwen3Config(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                         ffn_dim=768, max_seq_len=2048),
    "debug_moe": Qwen3Config(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                             ffn_dim=768, moe=_moe(experts=8, top_k=2, expert_dim=128), max_seq_len=2048),
    "0.6B": Qwen3Config(vocab_size=_VOCAB, dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=3072,
                        tie_embeddings=True),
    "1.7B": Qwen3Config(vocab_size=_VOCAB, dim=2048, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=6144,
                        tie_embeddings=True),
    "4B": Qwen3Config(vocab_size=_VOCAB, dim=2560, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=9728,
                      tie_embeddings=True),
    "8B": Qwen3Config(vocab_size=_VOCAB, dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=12288),
    "14B": Qwen3Config(vocab_size=_VOCAB, dim=5120, num_layers=40, num_heads=40, num_kv_heads=8, ffn_dim=17408),
    "32B": Qwen3Config(vocab_size=_VOCAB, dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, ffn_dim=25600),
    "30B-A3B": Qwen3Config(vocab_size=_VOCAB, dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, ffn_dim=6144,
                           moe=_moe(experts=128, top_k=8, expert_dim=768)),
    "235B-A22B": Qwen3Config(vocab_size=_VOCAB, dim=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                             ffn_dim=12288, moe=_moe(experts=128, top_k=8, expert_dim=1536)),
}

# (total, activated) parameters as the Qwen3 model cards state them (activated only for MoE).
# Qwen's activated figures include the embedding table.
PUBLISHED_PARAMS: dict[str, PublishedSize] = {
    "0.6B": PublishedSize(total="0.6B"), "1.7B": PublishedSize(total="1.7B"), "4B": PublishedSize(total="4.0B"),
    "8B": PublishedSize(total="8.2B"), "14B": PublishedSize(total="14.8B"), "32B": PublishedSize(total="32.8B"),
    "30B-A3B": PublishedSize(total="30.5B", active="3.3B"), "235B-A22B": PublishedSize(total="235B", active="22B"),
}
