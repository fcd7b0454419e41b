"""Qwen3-VL flavors: a tiny debug model for tests and CPU demos."""
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

PUBLISHED_PARAMS: dict[str, PublishedSize] = {}
