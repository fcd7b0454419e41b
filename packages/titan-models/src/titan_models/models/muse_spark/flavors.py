"""Muse Spark flavors: a tiny debug model (dense and sparse layers) and Muse-Spark-Open-816B-A42B
(transformers 5.20's MuseSparkTextConfig defaults, which its docstring names that checkpoint: hidden 8192,
62 layers (46 sliding, 16 full without RoPE), 128 heads of 64, 16 KV heads, 256 experts top-8 of width 4096
at the pooled width 4096, all layers sparse, vocabulary 202048)."""
from __future__ import annotations

from titan_models.models.muse_spark.model import MuseSparkConfig, muse_spark_moe
from titan_models.registry import PublishedSize

_MULTIPLIER = 0.1767766952966369  # 1 / sqrt(8192 / 256)

FLAVORS: dict[str, MuseSparkConfig] = {
    "debug": MuseSparkConfig(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                             ffn_dim=512, mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
                             moe=muse_spark_moe(num_experts=8, top_k=2, expert_dim=128, moe_dim=128,
                                                output_multiplier=0.5),
                             output_multiplier=0.5, sliding_window=64, max_seq_len=2048),
    "816B-A42B": MuseSparkConfig(vocab_size=202_048, dim=8192, num_layers=62, num_heads=128, num_kv_heads=16,
                                 head_dim=64, ffn_dim=16384,
                                 moe=muse_spark_moe(num_experts=256, top_k=8, expert_dim=4096, moe_dim=4096,
                                                    output_multiplier=_MULTIPLIER)),
}

# "an approximately 816B-parameter language backbone and 42B active parameters per token" (NVIDIA NeMo's
# model page): the backbone without the embedding and output tables (see __init__.py's count).
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"816B-A42B": PublishedSize(total="816B", active="42B")}
