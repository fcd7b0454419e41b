"""gpt-oss flavors: a tiny debug model and the two published sizes (gpt-oss-20b, gpt-oss-120b)."""
from __future__ import annotations

from titan_models.models.gpt_oss.model import GptOssConfig, gpt_oss_moe
from titan_models.registry import PublishedSize

_VOCAB = 201088  # o200k_harmony, padded

FLAVORS: dict[str, GptOssConfig] = {
    "debug": GptOssConfig(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                          moe=gpt_oss_moe(num_experts=8, top_k=2, expert_dim=128), sliding_window=64,
                          max_seq_len=2048),
    "20b": GptOssConfig(vocab_size=_VOCAB, dim=2880, num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64,
                        moe=gpt_oss_moe(num_experts=32, top_k=4, expert_dim=2880)),
    "120b": GptOssConfig(vocab_size=_VOCAB, dim=2880, num_layers=36, num_heads=64, num_kv_heads=8, head_dim=64,
                         moe=gpt_oss_moe(num_experts=128, top_k=4, expert_dim=2880)),
}

# (total, activated) parameters as OpenAI's gpt-oss model card states them; the activated figures leave
# out the input embedding (a lookup), the unembedding included.
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"20b": PublishedSize(total="20.9B", active="3.6B"),
                                              "120b": PublishedSize(total="116.8B", active="5.1B")}
