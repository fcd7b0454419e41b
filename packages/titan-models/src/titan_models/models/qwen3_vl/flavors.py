"""Qwen3-VL flavors: tiny debug models for tests and CPU demos, and the published Qwen3-VL sizes (the Qwen3
text shapes with a 24-block 1024-wide or 27-block 1152-wide tower, 16-pixel patches, 2x2 merge)."""
from __future__ import annotations

from titan_models.components.moe import MoEConfig
from titan_models.models.qwen3_vl.model import Qwen3VLConfig
from titan_models.models.qwen3_vl.vision import VisionConfig
from titan_models.registry import PublishedSize

_DEBUG = dict(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=768,
              max_seq_len=2048, mrope_sections=(12, 10, 10),
              vision=VisionConfig(depth=4, dim=128, ffn_dim=384, num_heads=4, out_dim=256, patch_size=16,
                                  num_position_embeddings=256, deepstack_layers=(1, 2)),
              image_token_id=2000, video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003)

FLAVORS: dict[str, Qwen3VLConfig] = {
    # 16-pixel patches, 2x2 merge: a 64x64 image is 16 text tokens
    "debug": Qwen3VLConfig(**_DEBUG),
    # Qwen3-VL-MoE: softmax top-k, always renormalised
    "debug_moe": Qwen3VLConfig(**_DEBUG, moe=MoEConfig(num_experts=8, top_k=2, expert_dim=96, score_func="softmax",
                                                       norm_topk_prob=True)),
}

_VOCAB = 151936
_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
_TEXT = dict(vocab_size=_VOCAB, rope_theta=5000000.0, max_seq_len=262144, mrope_sections=(24, 20, 20))


def _tower(*, large: bool, out_dim: int) -> VisionConfig:
    if large:
        return VisionConfig(depth=27, dim=1152, ffn_dim=4304, num_heads=16, out_dim=out_dim, deepstack_layers=(8, 16, 24))
    return VisionConfig(depth=24, dim=1024, ffn_dim=4096, num_heads=16, out_dim=out_dim, deepstack_layers=(5, 11, 17))


FLAVORS |= {
    "2B": Qwen3VLConfig(**_TEXT, **_TOKENS, dim=2048, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=6144,
                        tie_embeddings=True, vision=_tower(large=False, out_dim=2048)),
    "4B": Qwen3VLConfig(**_TEXT, **_TOKENS, dim=2560, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=9728,
                        tie_embeddings=True, vision=_tower(large=False, out_dim=2560)),
    "8B": Qwen3VLConfig(**_TEXT, **_TOKENS, dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=12288,
                        vision=_tower(large=True, out_dim=4096)),
    "30B-A3B": Qwen3VLConfig(**_TEXT, **_TOKENS, dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, ffn_dim=6144,
                             moe=MoEConfig(num_experts=128, top_k=8, expert_dim=768, score_func="softmax",
                                           norm_topk_prob=True), vision=_tower(large=True, out_dim=2048)),
}

# As the model names state them (Qwen3-VL-2B, -4B, -8B, -30B-A3B; the 30B-A3B's tower and embedding take it to
# 31B, what its model page lists); activated figures include the embedding and the tower.
PUBLISHED_PARAMS: dict[str, PublishedSize] = {
    "2B": PublishedSize(total="2B"), "4B": PublishedSize(total="4B"), "8B": PublishedSize(total="8B"),
    "30B-A3B": PublishedSize(total="31B", active="3B"),
}
