"""Muse Glimmer flavors: a tiny debug model and Muse-Glimmer-30B (transformers 5.20's MuseGlimmerTextConfig
defaults, which its docstring names meta-models/Muse-Glimmer-30B: hidden 6656, 52 layers, 32 heads of 128,
2 KV heads, SwiGLU 19968, vocabulary 202048, window 2048)."""
from __future__ import annotations

import dataclasses

from titan_models.models.muse_glimmer.model import MuseGlimmerConfig
from titan_models.models.muse_glimmer.vision import MuseVisionConfig
from titan_models.registry import PublishedSize

FLAVORS: dict[str, MuseGlimmerConfig] = {
    "debug": MuseGlimmerConfig(vocab_size=2048, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                               ffn_dim=512, sliding_window=64, max_seq_len=2048),
    "30B": MuseGlimmerConfig(vocab_size=202_048, dim=6656, num_layers=52, num_heads=32, num_kv_heads=2,
                             head_dim=128, ffn_dim=19968),
}
# the debug text model with a small tower: 14-pixel patches, 8 x 8-patch windows, 2x2 merge
FLAVORS["debug_vision"] = dataclasses.replace(
    FLAVORS["debug"], image_token_id=2000, video_token_id=2001, image_start_token_id=2002, image_end_token_id=2003,
    vision=MuseVisionConfig(depth=4, dim=64, ffn_dim=128, num_heads=2, adapter_dim=128, out_dim=256, pos_emb_size=8))

# Meta's "30B" (29.6-29.8B in the model cards) counts the ~1.9B perception encoder the text model leaves out
# (see __init__.py's count).
PUBLISHED_PARAMS: dict[str, PublishedSize] = {"30B": PublishedSize(total="30B")}
