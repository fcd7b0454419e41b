"""Llama 3 flavors: a tiny debug model and the published Llama 3.1 / 3.2 sizes.

`PUBLISHED_PARAMS` are the sizes Meta / Hugging Face state for each checkpoint.
"""
from __future__ import annotations

from titan_models.components.rope import Llama3RopeScaling
from titan_models.models.llama3.model import Llama3Config
from titan_models.registry import PublishedSize

_VOCAB = 128256

FLAVORS: dict[str, Llama3Config] = {
    # Tiny, for tests and CPU demos; vocab fits a byte-level tokenizer (256 + specials) with room.
    "debug": Llama3Config(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=768,
                          max_seq_len=2048),
    # debug with the output projection tied to the embedding, as the 1B and 3B flavors are.
    "debug_tied": Llama3Config(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=768,
                               max_seq_len=2048, tie_embeddings=True),
    "1B": Llama3Config(vocab_size=_VOCAB, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_dim=8192,
                       head_dim=64, tie_embeddings=True,
                       rope_scaling=Llama3RopeScaling(factor=32.0, original_max_seq_len=8192)),
    "3B": Llama3Config(vocab_size=_VOCAB, dim=3072, num_layers=28, num_heads=24, num_kv_heads=8, ffn_dim=8192,
                       head_dim=128, tie_embeddings=True,
                       rope_scaling=Llama3RopeScaling(factor=32.0, original_max_seq_len=8192)),
    "8B": Llama3Config(vocab_size=_VOCAB, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                       rope_scaling=Llama3RopeScaling(factor=8.0, original_max_seq_len=8192)),
    "70B": Llama3Config(vocab_size=_VOCAB, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                        rope_scaling=Llama3RopeScaling(factor=8.0, original_max_seq_len=8192)),
    "405B": Llama3Config(vocab_size=_VOCAB, dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                         ffn_dim=53248, rope_scaling=Llama3RopeScaling(factor=8.0, original_max_seq_len=8192)),
}

# Total parameters as published on the Hugging Face model cards (meta-llama/Llama-3.2-1B, -3B,
# Llama-3.1-8B, -70B, -405B).
PUBLISHED_PARAMS: dict[str, PublishedSize] = {
    name: PublishedSize(total=total)
    for name, total in {"1B": "1.24B", "3B": "3.21B", "8B": "8.03B", "70B": "70.6B", "405B": "406B"}.items()}
