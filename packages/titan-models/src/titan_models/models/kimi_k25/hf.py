"""Kimi_K25ForConditionalGeneration (model type `kimi_k25`: Kimi-K2.5/K2.6) <-> KimiK25Config.

The text model is DeepSeek-V3's (read as titan_models.models.deepseek_v3.hf describes: the decoder under
`language_model.model.layers.*` or transformers' `language_model.model.blocks.*`, the head tied by the
top-level `tie_word_embeddings` unless stored); the vision tower keeps the release names, which
transformers 5.20 also writes: `vision_tower.encoder.blocks.N.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}`,
`vision_tower.encoder.{patch_embed.proj, final_layernorm}`, `vision_tower.patch_embed.pos_emb.weight`
[h, w, dim], `mm_projector.{pre_norm, proj.0, proj.2}` (transformers writes `model.mm_projector.pre_norm`;
both are read, the release name is written). `wqkv` is loaded as stored: its query/key channels pair
up for the rotation (transformers permutes them into halves on load; the attention is the same).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from titan_models.hf.converter import check_field_types, require
from titan_models.hf.names import NoHFName
from titan_models.models.deepseek_v3.hf import _KIMI_K25, DeepSeekV3Converter
from titan_models.models.deepseek_v3.model import DeepSeekV3Config
from titan_models.models.kimi_k25.model import KimiK25Config
from titan_models.models.kimi_k25.vision import KimiVisionConfig
from titan_models.registry import TinyHFCase

_BLOCK = {"attention_norm": "norm0", "attention.wqkv": "wqkv", "attention.wo": "wo", "ffn_norm": "norm1",
          "feed_forward.w1": "mlp.fc0", "feed_forward.w2": "mlp.fc1"}
_TOP = {"patch_embed.weight": "vision_tower.encoder.patch_embed.proj.weight",
        "patch_embed.bias": "vision_tower.encoder.patch_embed.proj.bias",
        "pos_embed": "vision_tower.patch_embed.pos_emb.weight",
        "norm.weight": "vision_tower.encoder.final_layernorm.weight",
        "norm.bias": "vision_tower.encoder.final_layernorm.bias",
        "projector.norm.weight": "mm_projector.pre_norm.weight", "projector.norm.bias": "mm_projector.pre_norm.bias",
        "projector.w1.weight": "mm_projector.proj.0.weight", "projector.w1.bias": "mm_projector.proj.0.bias",
        "projector.w2.weight": "mm_projector.proj.2.weight", "projector.w2.bias": "mm_projector.proj.2.bias"}
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_PRE_NORM_AS_SAVED = "model.mm_projector.pre_norm."  # where transformers' save_pretrained puts the projector norm


def _vision_name(name: str) -> str:
    rest = name.removeprefix("visual.")
    if rest in _TOP:
        return _TOP[rest]
    match = _BLOCK_NAME.fullmatch(rest)
    if match is None or match[2] not in _BLOCK:
        raise NoHFName(name)
    return f"vision_tower.encoder.blocks.{match[1]}.{_BLOCK[match[2]]}.{match[3]}"


def _vision_from_hf(hf: dict[str, Any], text_dim: int) -> KimiVisionConfig:
    vision = hf.get("vision_config") or {}
    check_field_types(vision, "config.json vision_config")
    require(vision, "hidden_act", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    merge = list(vision.get("merge_kernel_size", (2, 2)))
    if len(merge) != 2 or merge[0] != merge[1]:
        raise ValueError(f"config.json field vision_config.merge_kernel_size={merge} is not supported; "
                         "supported: a square kernel [m, m]")
    height, width = vision.get("pos_emb_height", 64), vision.get("pos_emb_width", 64)
    if height != width:  # transformers indexes the table as a square of side pos_emb_height
        raise ValueError(f"config.json fields vision_config.pos_emb_height={height} and pos_emb_width={width} "
                         "must be equal (a square position table)")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"config.json field vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                         "supported; supported: ['axial']")
    dim = vision.get("hidden_size", 1152)
    if hf.get("projection_hidden_size", 1152) != dim:
        raise ValueError(f"config.json field projection_hidden_size={hf.get('projection_hidden_size', 1152)} must "
                         f"equal vision_config.hidden_size={dim} (the projector norms each patch of the tower)")
    return KimiVisionConfig(
        depth=vision.get("num_hidden_layers", 27), dim=dim, ffn_dim=vision.get("intermediate_size", 4304),
        num_heads=vision.get("num_attention_heads", 16), out_dim=text_dim, patch_size=vision.get("patch_size", 14),
        pos_emb_size=height, merge_size=merge[0], rope_theta=float(rope.get("rope_theta", 10000.0)),
        projector_norm_eps=float(hf.get("projection_layer_norm_eps", 1e-5)))


class KimiK25Converter(DeepSeekV3Converter):
    architectures = (_KIMI_K25,)
    config_type = KimiK25Config

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> KimiK25Config:
        text = super().config_from_hf(hf, tensor_names)  # checks text_config, resolves the tie
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(DeepSeekV3Config)}
        return KimiK25Config(
            **fields, vision=_vision_from_hf(hf, text.dim), image_token_id=hf.get("image_token_id", 163605),
            video_token_id=hf.get("video_token_id", 163840),
            vision_start_token_id=hf.get("vision_start_token_id", 163602),
            vision_end_token_id=hf.get("vision_end_token_id", 163604))

    def config_to_hf(self, config: KimiK25Config) -> dict[str, Any]:
        text = super().config_to_hf(config.text_config())
        dtype = text.pop("dtype")
        text.pop("architectures")
        v = config.vision
        vision = {"model_type": "kimi_k25_vision", "patch_size": v.patch_size, "pos_emb_height": v.pos_emb_size,
                  "pos_emb_width": v.pos_emb_size, "pos_emb_time": 4, "num_attention_heads": v.num_heads,
                  "num_hidden_layers": v.depth, "hidden_size": v.dim, "intermediate_size": v.ffn_dim,
                  "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [v.merge_size, v.merge_size],
                  "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
        return {"architectures": [_KIMI_K25], "model_type": "kimi_k25", "text_config": text, "vision_config": vision,
                "projection_hidden_size": v.dim, "projection_layer_norm_eps": v.projector_norm_eps,
                "image_token_id": config.image_token_id, "video_token_id": config.video_token_id,
                "vision_start_token_id": config.vision_start_token_id,
                "vision_end_token_id": config.vision_end_token_id, "tie_word_embeddings": config.tie_embeddings,
                "dtype": dtype}

    def hf_names(self, config: KimiK25Config, name: str) -> list[str]:
        if name.startswith("visual."):
            return [_vision_name(name)]
        if name == "output.weight":  # both layouts keep the head here (checkpoint_prefixes moves "lm_head.")
            return ["language_model.lm_head.weight"]
        return super().hf_names(config, name)

    def checkpoint_prefixes(self, tensor_names: set[str]) -> dict[str, str]:
        prefixes = super().checkpoint_prefixes(tensor_names)
        if any(n.startswith(_PRE_NORM_AS_SAVED) for n in tensor_names):  # before "model.": it is not the decoder's
            prefixes = {"mm_projector.pre_norm.": _PRE_NORM_AS_SAVED} | prefixes
        return prefixes

    def written_text_prefix(self, config: KimiK25Config) -> str:
        return "language_model.model."  # the release layout

    def reported(self, config: KimiK25Config, hf_name: str) -> bool:
        return False  # the tower loads: nothing is left over


_TINY_TEXT = {"model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_group": 1,
              "topk_group": 1, "max_position_embeddings": 256, "q_lora_rank": 24, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# A two-block tower, 4-pixel patches, an 8 x 8 position table (images larger and smaller than it resample it).
# text_config's tie_word_embeddings=False is overridden by the composite's default (tied). q_lora_rank is set:
# transformers 5.20 saves a full-rank `self_attn.q_proj` as `self_wqkv` (its vision rename reversed), a name no
# checkpoint has. The image/video placeholder ids lie outside the vocabulary (transformers embeds placeholder
# tokens as token 0), the start/end markers inside it.
TINY_CONFIG = {"model_type": "kimi_k25", "architectures": [_KIMI_K25], "text_config": _TINY_TEXT,
               "vision_config": {"patch_size": 4, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2,
                                 "num_attention_heads": 2, "num_hidden_layers": 2, "hidden_size": 32,
                                 "intermediate_size": 64},
               "projection_hidden_size": 32, "image_token_id": 130, "video_token_id": 131,
               "vision_start_token_id": 126, "vision_end_token_id": 127}
# Tiny random checkpoints for the registry-driven parity tests (text-only calls; images: test_kimi_k25_vision.py).
TINY_HF_CONFIGS = {"composite": TinyHFCase(config=TINY_CONFIG, auto_class="AutoModelForImageTextToText")}
