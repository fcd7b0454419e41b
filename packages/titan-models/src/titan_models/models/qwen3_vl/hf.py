"""Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration <-> Qwen3VLConfig.

The checkpoint is composite: the text model under `model.language_model.` (Qwen3's names), the vision
tower under `model.visual.`, `lm_head.weight` at the top; config.json keeps the text settings in
`text_config` (MRoPE in its `rope_parameters`: `mrope_section`, `mrope_interleaved`) and the tower's in
`vision_config`. transformers maps these architectures only through AutoModelForImageTextToText.

MoE experts are stored fused per layer, as transformers 5.x saves them: `mlp.experts.gate_up_proj`
[E, 2 * expert_dim, dim] (gate rows, then up rows) and `mlp.experts.down_proj` [E, dim, expert_dim]; the
router always renormalises the top-k (config.json has no norm_topk_prob). The first published release's
transposed layout ([E, dim, 2 * expert_dim], [E, expert_dim, dim]) is not read yet.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titan_models.hf.converter import Converter, check_field_types, require
from titan_models.hf.names import NoHFName
from titan_models.models.qwen3.hf import Qwen3Converter
from titan_models.models.qwen3.model import Qwen3Config
from titan_models.models.qwen3_vl.model import Qwen3VLConfig
from titan_models.models.qwen3_vl.vision import VisionConfig
from titan_models.registry import TinyHFCase

_TEXT = Qwen3Converter()
_VISION_BLOCK = {"attention_norm": "norm1", "attention.qkv": "attn.qkv", "attention.wo": "attn.proj",
                 "ffn_norm": "norm2", "feed_forward.w1": "mlp.linear_fc1", "feed_forward.w2": "mlp.linear_fc2"}
_MERGER = {"norm": "norm", "w1": "linear_fc1", "w2": "linear_fc2"}
_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_FUSED = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
_VISION = re.compile(r"visual\.(?:blocks\.(\d+)\.(.+)|(merger)\.(\w+)|deepstack_mergers\.(\d+)\.(\w+)|"
                     r"(patch_embed|pos_embed))\.(weight|bias)")


def _vision_name(name: str) -> str:
    match = _VISION.fullmatch(name)
    if match is None:
        raise NoHFName(name)
    block, block_rest, _, merger_rest, deepstack, deepstack_rest, top, kind = match.groups()
    if block is not None and block_rest in _VISION_BLOCK:
        return f"model.visual.blocks.{block}.{_VISION_BLOCK[block_rest]}.{kind}"
    if merger_rest in _MERGER:
        return f"model.visual.merger.{_MERGER[merger_rest]}.{kind}"
    if deepstack_rest in _MERGER:
        return f"model.visual.deepstack_merger_list.{deepstack}.{_MERGER[deepstack_rest]}.{kind}"
    if top is not None:
        return f"model.visual.{'patch_embed.proj' if top == 'patch_embed' else top}.{kind}"
    raise NoHFName(name)


def _vision_from_hf(vision: dict[str, Any]) -> VisionConfig:
    require(vision, "hidden_act", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"config.json field vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                         "supported; supported: ['axial']")
    return VisionConfig(
        depth=vision["depth"], dim=vision["hidden_size"], ffn_dim=vision["intermediate_size"],
        num_heads=vision["num_heads"], out_dim=vision["out_hidden_size"], patch_size=vision.get("patch_size", 16),
        temporal_patch_size=vision.get("temporal_patch_size", 2), spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", 3), num_position_embeddings=vision.get("num_position_embeddings", 2304),
        deepstack_layers=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))),
        rope_theta=float(rope.get("rope_theta", 10000.0)))


class Qwen3VLConverter(Converter):
    architectures = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
    config_type = Qwen3VLConfig

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Qwen3VLConfig:
        text, vision = hf.get("text_config"), hf.get("vision_config")
        check_field_types(text, "config.json text_config")
        check_field_types(vision, "config.json vision_config")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if not rope.get("mrope_interleaved", True):
            raise ValueError("config.json field text_config.rope_parameters.mrope_interleaved=false (chunked MRoPE) "
                             "is not supported; supported: [true]")
        sections = tuple(rope.get("mrope_section", (24, 20, 20)))
        if len(sections) != 3:
            raise ValueError(f"config.json field text_config.rope_parameters.mrope_section={list(sections)} must "
                             "have three entries (t, h, w)")
        moe = "Qwen3VLMoeForConditionalGeneration" in hf.get("architectures", [])
        if moe:  # always renormalised: the field is not in the config
            text = text | {"norm_topk_prob": True}
        text = text | {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"], "rope_parameters": {
            k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}}
        # the top-level field decides (the MoE text config defaults to true while the model is untied)
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
        base = _TEXT.config_from_hf(text, set())
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Qwen3Config)}
        return Qwen3VLConfig(**fields, vision=_vision_from_hf(vision), mrope_sections=sections,
                             image_token_id=hf.get("image_token_id", 151655),
                             video_token_id=hf.get("video_token_id", 151656),
                             vision_start_token_id=hf.get("vision_start_token_id", 151652),
                             vision_end_token_id=hf.get("vision_end_token_id", 151653))

    def config_to_hf(self, config: Qwen3VLConfig) -> dict[str, Any]:
        moe = config.moe is not None
        if moe and not config.moe.norm_topk_prob:
            raise ValueError("Qwen3VLMoeForConditionalGeneration always renormalises the top-k routing weights; "
                             "this config has moe.norm_topk_prob=False")
        text = _TEXT.config_to_hf(config)
        dtype = text.pop("dtype")
        for key in ("architectures", "rope_scaling", "rope_theta", "norm_topk_prob"):
            text.pop(key, None)
        text |= {"model_type": "qwen3_vl_moe_text" if moe else "qwen3_vl_text", "rope_parameters": text["rope_parameters"] | {
            "mrope_section": list(config.mrope_sections), "mrope_interleaved": True}}
        v = config.vision
        vision = {"model_type": "qwen3_vl_moe_vision" if moe else "qwen3_vl_vision", "depth": v.depth, "hidden_size": v.dim,
                  "intermediate_size": v.ffn_dim, "num_heads": v.num_heads, "out_hidden_size": v.out_dim,
                  "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
                  "spatial_merge_size": v.spatial_merge_size, "in_channels": v.in_channels,
                  "num_position_embeddings": v.num_position_embeddings, "hidden_act": "gelu_pytorch_tanh",
                  "deepstack_visual_indexes": list(v.deepstack_layers),
                  "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
        return {"architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
                "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
                "text_config": text, "vision_config": vision, "image_token_id": config.image_token_id,
                "video_token_id": config.video_token_id, "vision_start_token_id": config.vision_start_token_id,
                "vision_end_token_id": config.vision_end_token_id, "tie_word_embeddings": config.tie_embeddings,
                "dtype": dtype}

    def hf_names(self, config: Qwen3VLConfig, name: str) -> list[str]:
        if name.startswith("visual."):
            return [_vision_name(name)]
        match = _EXPERTS.fullmatch(name)
        if match is not None:
            return [f"model.language_model.layers.{match[1]}.mlp.experts.{_FUSED[match[2]]}"]
        return [n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n
                for n in _TEXT.hf_names(config, name)]

    def disk_layout(self, config: Qwen3VLConfig, name: str, shape: tuple[int, ...], present: set[str]
                    ) -> dict[str, tuple[int, ...]] | None:
        match = _EXPERTS.fullmatch(name)
        if match is None:
            return None
        (hf_name,) = self.hf_names(config, name)
        e, ffn, dim = config.moe.num_experts, config.moe.expert_dim, config.dim
        return {hf_name: (e, dim, ffn) if match[2] == "w2" else (e, 2 * ffn, dim)}

    def load(self, config: Qwen3VLConfig, name: str, files: Any, present: set[str]) -> torch.Tensor:
        (hf_name,) = self.hf_names(config, name)
        kind, ffn = _EXPERTS.fullmatch(name)[2], config.moe.expert_dim
        fused = files.get(hf_name)
        return {"w1": fused[:, :ffn], "w3": fused[:, ffn:], "w2": fused}[kind]

    def to_hf_tensor(self, config: Qwen3VLConfig, hf_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        by_kind = {_EXPERTS.fullmatch(n)[2]: t for n, t in parts.items()}
        return by_kind["w2"] if "w2" in by_kind else torch.cat([by_kind["w1"], by_kind["w3"]], dim=1)

    def ignorable(self, config: Qwen3VLConfig, hf_name: str) -> bool:
        return config.tie_embeddings and hf_name == "lm_head.weight"


_TINY_TEXT = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
_TINY_VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
                "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 2]}
TINY_CONFIG = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
               "image_token_id": 150, "video_token_id": 151, "vision_start_token_id": 152,
               "vision_end_token_id": 153, "text_config": _TINY_TEXT, "vision_config": _TINY_VISION}
# Tiny random checkpoints for the registry-driven parity tests (text-only calls; images: test_qwen3_vl_hf.py).
# MoE: layer 0 dense; expert_dim 24 so that dim (64) != 2 * expert_dim and the fused layout is unambiguous
TINY_MOE_CONFIG = TINY_CONFIG | {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
    "text_config": _TINY_TEXT | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                 "decoder_sparse_step": 1, "mlp_only_layers": [0]}}
TINY_HF_CONFIGS = {
    "dense": TinyHFCase(config=TINY_CONFIG, auto_class="AutoModelForImageTextToText"),
    "dense-tied": TinyHFCase(config=TINY_CONFIG | {"tie_word_embeddings": True},
                             auto_class="AutoModelForImageTextToText"),
    "moe-dense-layer0": TinyHFCase(config=TINY_MOE_CONFIG, auto_class="AutoModelForImageTextToText"),
}
