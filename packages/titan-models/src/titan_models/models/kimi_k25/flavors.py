"""Kimi K2.x flavors: a tiny debug model for tests and CPU demos, and Kimi K2.6 (the deepseek_v3 family's
`kimi-k2.6` text model with its 27-block, 1152-wide MoonViT tower: 14-pixel patches, 2x2 merge)."""
from __future__ import annotations

import dataclasses

from titan_models.models.deepseek_v3.flavors import FLAVORS as TEXT_FLAVORS
from titan_models.models.kimi_k25.model import KimiK25Config
from titan_models.models.kimi_k25.vision import KimiVisionConfig
from titan_models.registry import PublishedSize


def _with_tower(text_flavor: str, vision: KimiVisionConfig, **tokens: int) -> KimiK25Config:
    text = TEXT_FLAVORS[text_flavor]
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return KimiK25Config(**fields | {"tie_embeddings": False, "mtp": False}, vision=vision, **tokens)


FLAVORS: dict[str, KimiK25Config] = {
    # 14-pixel patches, 2x2 merge: a 56x56 image is 4 x 4 patches, 4 text tokens
    "debug": _with_tower("debug", KimiVisionConfig(depth=2, dim=128, ffn_dim=384, num_heads=4, out_dim=256,
                                                   pos_emb_size=16),
                         image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                         vision_end_token_id=2003),
    "kimi-k2.6": _with_tower("kimi-k2.6", KimiVisionConfig(depth=27, dim=1152, ffn_dim=4304, num_heads=16,
                                                           out_dim=7168)),
}

# The Kimi K2.6 card's 1T total / 32B activated (the tower's 0.4B is within the rounding)
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"kimi-k2.6": PublishedSize(total="1T", active="32B")}
