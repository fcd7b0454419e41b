"""Muse Glimmer (`MuseGlimmerForConditionalGeneration`, the composite image-text checkpoint transformers
maps Muse to) <-> MuseGlimmerConfig. `MuseConverter` is what Muse Spark's converter shares.

The text model sits under `model.language_model.*` beside `model.vision_tower.*`, `model.vision_adapter.*`
and `model.vision_projection.*` (Spark: also `model.audio_tower.*`), with `lm_head.weight` at the top and
the text settings in `text_config`. Muse Glimmer: from_hf loads the vision tower, adapter and projection
when the folder holds them (`MuseGlimmerConfig.vision`; names as transformers keeps them, written whole);
otherwise, and for Spark's towers, it loads the text model and lists the towers' tensors in a
warning; the composite's other fields (tower sub-configs, image token ids) are kept in the config's
`hf_multimodal` so that to_hf writes the same composite config (with the text weights only: transformers
then initialises the towers). Per-layer `layer_rope_theta`: 0 marks a NoPE layer, other values are
ignored (transformers uses the global theta for every rotary layer).
"""
from __future__ import annotations

import re
from typing import Any

from titan_models.hf.converter import Converter, check_field_types, dtype_name, require
from titan_models.hf.names import DENSE_LAYER, NoHFName
from titan_models.hf.rope_config import read_rope
from titan_models.models.muse_glimmer.model import LAYER_TYPES, MuseGlimmerConfig, MuseTextConfig
from titan_models.models.muse_glimmer.vision import MuseVisionConfig
from titan_models.registry import TinyHFCase

MUSE_LAYER = DENSE_LAYER | {
    "attention.wg.weight": "self_attn.gate_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_TOWERS = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.", "model.audio_tower.")
# composite fields that are neither the text model's nor kept for to_hf
_NOT_KEPT = ("text_config", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
             "tie_word_embeddings")


def _field(text: dict[str, Any], name: str, default: Any) -> Any:
    value = text.get(name, default)
    return default if value is None else value


class MuseConverter(Converter):
    """The text fields and tensor names Muse Glimmer and Muse Spark share."""

    model_type = ""
    default_rope_theta = 10_000.0

    def text_fields(self, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the text config dict, MuseTextConfig keyword arguments read from it)."""
        text = hf.get("text_config") or hf
        if text is not hf:
            check_field_types(text, "config.json field text_config")
        require(text, "attention_bias", (False,), False)
        layers = text["num_hidden_layers"]
        theta, _ = read_rope(text if text.get("rope_parameters") or "rope_theta" in text
                             else {"rope_theta": self.default_rope_theta}, allowed=())
        layer_types = text.get("layer_types")
        if layer_types is not None:
            bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
            if bad or len(layer_types) != layers:
                raise ValueError(f"config.json field layer_types={layer_types} needs {layers} entries of "
                                 f"{list(LAYER_TYPES)}")
            layer_types = tuple(layer_types)
        thetas = text.get("layer_rope_theta")
        if thetas is not None and (not isinstance(thetas, list) or len(thetas) != layers):
            raise ValueError(f"config.json field layer_rope_theta must list {layers} numbers (0 = no RoPE), "
                             f"got {thetas!r}")
        softcap = _field(text, "final_logit_softcapping", 20.0)
        if not isinstance(softcap, (int, float)) or softcap <= 0:
            raise ValueError(f"config.json field final_logit_softcapping must be a positive number, got {softcap!r}")
        heads = text["num_attention_heads"]
        fields = dict(
            vocab_size=text["vocab_size"], dim=text["hidden_size"], num_layers=layers, num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads, layer_types=layer_types,
            nope_layers=None if thetas is None else tuple(i for i, t in enumerate(thetas) if t == 0),
            sliding_window=_field(text, "sliding_window", 2048), rms_norm_eps=_field(text, "rms_norm_eps", 1e-5),
            post_norm_eps=_field(text, "post_norm_eps", 1e-8), logit_softcap=float(softcap), rope_theta=theta,
            max_seq_len=_field(text, "max_position_embeddings", 131_072),
            tie_embeddings=hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            hf_multimodal={k: v for k, v in hf.items() if k not in _NOT_KEPT} if text is not hf else None)
        for name in ("qk_scale_factor", "output_multiplier"):
            if text.get(name) is not None:
                fields[name] = float(text[name])
        return text, fields

    def text_to_hf(self, config: MuseTextConfig) -> dict[str, Any]:
        nope = set(config.resolved_nope_layers())
        return {
            "model_type": f"{self.model_type}_text", "vocab_size": config.vocab_size, "hidden_size": config.dim,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "intermediate_size": config.ffn_dim, "layer_types": list(config.layer_kinds()),
            "layer_rope_theta": [0 if i in nope else config.rope_theta for i in range(config.num_layers)],
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "sliding_window": config.sliding_window, "rms_norm_eps": config.rms_norm_eps,
            "post_norm_eps": config.post_norm_eps, "qk_scale_factor": config.qk_scale_factor,
            "output_multiplier": config.output_multiplier, "final_logit_softcapping": config.logit_softcap,
            "max_position_embeddings": config.max_seq_len, "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False,
        }

    def composite(self, config: MuseTextConfig, text: dict[str, Any], default_towers: dict[str, Any]
                  ) -> dict[str, Any]:
        if config.logit_softcap is None:
            raise ValueError(f"{self.architectures[0]} always soft-caps its logits; logit_softcap=None cannot be written")
        towers = config.hf_multimodal if config.hf_multimodal is not None else default_towers
        return {"architectures": [self.architectures[0]], "model_type": self.model_type, **towers,
                "text_config": text, "tie_word_embeddings": config.tie_embeddings, "dtype": dtype_name(config.dtype)}

    def layer_map(self, config: Any) -> dict[str, str]:
        return MUSE_LAYER

    def hf_names(self, config: Any, name: str) -> list[str]:
        if name in _TOP_LEVEL:
            return [_TOP_LEVEL[name]]
        match = _LAYER.fullmatch(name)
        mapped = self.layer_map(config).get(match[2]) if match is not None else None
        if mapped is None:
            raise NoHFName(name)
        return [f"model.layers.{match[1]}.{mapped}"] if mapped else []

    def text_prefix(self, tensor_names: set[str]) -> str:
        composite = any(n.startswith("model.language_model.") for n in tensor_names)
        return "model.language_model." if composite else "model."

    def written_text_prefix(self, config: Any) -> str:
        return "model.language_model."  # transformers has no text-only Muse causal LM

    def reported(self, config: Any, hf_name: str) -> bool:
        return hf_name.startswith(_TOWERS)


class MuseGlimmerConverter(MuseConverter):
    architectures = ("MuseGlimmerForConditionalGeneration",)
    config_type = MuseGlimmerConfig
    model_type = "muse_glimmer"

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> MuseGlimmerConfig:
        text, fields = self.text_fields(hf)
        require(text, "hidden_activation", ("silu",), "silu")
        # the tower is built for a composite config whose folder holds it (or when no folder is given)
        towers = not tensor_names or _has_tower(tensor_names)
        vision = _vision_from_hf(hf, fields) if text is not hf and hf.get("vision_config") and towers else None
        return MuseGlimmerConfig(**fields, ffn_dim=text["intermediate_size"], vision=vision,
                                 image_token_id=hf.get("image_token_id", 200092) if vision else None,
                                 video_token_id=hf.get("video_token_id", 200091) if vision else None)

    def config_to_hf(self, config: MuseGlimmerConfig) -> dict[str, Any]:
        hf = self.composite(config, self.text_to_hf(config) | {"hidden_activation": "silu"}, {})
        return hf if config.vision is None else hf | _vision_to_hf(config)

    def hf_names(self, config: Any, name: str) -> list[str]:
        if name.startswith("visual."):
            return [vision_hf_name(name.removeprefix("visual."))]
        names = super().hf_names(config, name)
        if config.vision is None:
            return names
        # with the tower, names are written whole (the tower's `model.*` must not move under the decoder's prefix)
        return [n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n for n in names]

    def checkpoint_prefixes(self, tensor_names: set[str]) -> dict[str, str]:
        return {"model.": "model."} if _has_tower(tensor_names) else super().checkpoint_prefixes(tensor_names)

    def written_text_prefix(self, config: Any) -> str:
        return "model." if config.vision is not None else super().written_text_prefix(config)


def _has_tower(tensor_names: set[str]) -> bool:
    return any(n.startswith("model.vision_tower.") for n in tensor_names)


def _vision_from_hf(hf: dict[str, Any], text: dict[str, Any]) -> MuseVisionConfig:
    vision = hf["vision_config"]
    check_field_types(vision, "config.json field vision_config")
    require(vision, "hidden_act", ("gelu",), "gelu")
    require(hf, "projector_hidden_act", ("gelu",), "gelu")
    side = vision.get("pos_emb_height", 32)
    if vision.get("pos_emb_width", 32) != side:
        raise ValueError(f"config.json fields vision_config.pos_emb_height={side} and pos_emb_width="
                         f"{vision.get('pos_emb_width', 32)} must be equal (transformers reads a square table)")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"config.json field vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                         "supported; supported: ['axial']")
    dim, merge, depth = vision.get("hidden_size", 1536), vision.get("merge_size", 2), vision.get("num_hidden_layers", 50)
    if hf.get("out_hidden_size", 6144) != dim * merge**2:
        raise ValueError(f"config.json field out_hidden_size={hf.get('out_hidden_size', 6144)} must be "
                         f"vision_config.hidden_size * merge_size**2 = {dim * merge**2}")
    layer_types = vision.get("layer_types")
    full = None if layer_types is None else tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    return MuseVisionConfig(
        depth=depth, dim=dim, ffn_dim=vision.get("intermediate_size", 8960),
        num_heads=vision.get("num_attention_heads", 16), adapter_dim=hf.get("projector_hidden_size", 4096),
        out_dim=text["dim"], patch_size=vision.get("patch_size", 14), patch_temporal=vision.get("patch_temporal", 2),
        pos_emb_size=side, merge_size=merge, full_attention_layers=full,
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
        text_norm_eps=text["rms_norm_eps"])


def _vision_to_hf(config: MuseGlimmerConfig) -> dict[str, Any]:
    v = config.vision
    full = set(v.resolved_full_attention_layers())
    kept = (config.hf_multimodal or {}).get("vision_config") or {}
    vision = kept | {
        "patch_size": v.patch_size, "pos_emb_height": v.pos_emb_size, "pos_emb_width": v.pos_emb_size,
        "num_attention_heads": v.num_heads, "num_hidden_layers": v.depth, "hidden_size": v.dim,
        "intermediate_size": v.ffn_dim, "hidden_act": "gelu", "patch_temporal": v.patch_temporal,
        "merge_size": v.merge_size, "layer_norm_eps": v.norm_eps,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        "layer_types": ["full_attention" if i in full else "window_attention" for i in range(v.depth)]}
    return {"vision_config": vision, "out_hidden_size": v.dim * v.merge_size**2, "projector_hidden_size": v.adapter_dim,
            "projector_hidden_act": "gelu", "image_token_id": config.image_token_id,
            "video_token_id": config.video_token_id}


def scale_lm_head(factor: float):
    """A TinyHFCase `prepare`: scale the reference's output weights so the logits reach the softcap's
    curved range (tiny random models keep them where tanh is linear)."""
    def prepare(model) -> None:
        model.lm_head.weight.data.mul_(factor)
    return prepare


# A one-block vision tower (merged output width out_hidden_size = hidden * merge_size^2). Image and video token
# id 0: the composite model embeds those placeholders as token 0 when no image is given, so with 0 its text path
# is the text model for any token (random test tokens hit any other id in the tiny vocabulary).
TINY_VISION = {"patch_size": 2, "pos_emb_height": 4, "pos_emb_width": 4, "num_attention_heads": 2,
               "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "merge_size": 2}
TINY_MULTIMODAL = {"vision_config": TINY_VISION, "image_token_id": 0, "video_token_id": 0,
                   "out_hidden_size": 128, "projector_hidden_size": 32}
# 80-token tests: windows of 8 keys; softcap 2 with multiplier 1.5 so the scaled head reaches tanh's curve
TINY_TEXT = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
             "max_position_embeddings": 256, "final_logit_softcapping": 2.0, "output_multiplier": 1.5,
             "qk_scale_factor": 2.5}

TINY_HF_CONFIGS = {
    "composite": TinyHFCase(
        config={"model_type": "muse_glimmer", "architectures": ["MuseGlimmerForConditionalGeneration"],
                "text_config": TINY_TEXT, **TINY_MULTIMODAL},
        auto_class="AutoModelForImageTextToText", prepare=scale_lm_head(30.0)),
    "custom-schedule": TinyHFCase(
        config={"model_type": "muse_glimmer", "architectures": ["MuseGlimmerForConditionalGeneration"],
                "text_config": TINY_TEXT | {
                    "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    "layer_rope_theta": [0, 5000.0, 1234.0, 0], "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 5000.0}},
                **TINY_MULTIMODAL},
        auto_class="AutoModelForImageTextToText", prepare=scale_lm_head(30.0)),
}


_VISION_TOP = {"patch_embed.weight": "model.vision_tower.patch_embedder.patch_embedding.weight",
               "pos_embed.weight": "model.vision_tower.patch_embedder.position_embedding_table.weight",
               "pre_norm.weight": "model.vision_tower.ln_pre.weight", "pre_norm.bias": "model.vision_tower.ln_pre.bias",
               "post_norm.weight": "model.vision_tower.ln_post.weight",
               "post_norm.bias": "model.vision_tower.ln_post.bias",
               "adapter_w1.weight": "model.vision_adapter.fc1.weight",
               "adapter_w2.weight": "model.vision_adapter.fc2.weight",
               "projection.weight": "model.vision_projection.weight"}
_VISION_BLOCK = {"attention_norm": "norm1", "attention.wq": "attn.q_proj", "attention.wk": "attn.k_proj",
                 "attention.wv": "attn.v_proj", "attention.wo": "attn.proj", "ffn_norm": "norm2", "w1": "mlp.fc1",
                 "w2": "mlp.fc2"}
_VISION_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")


def vision_hf_name(name: str) -> str:
    """The HF name of a MuseVisionTower tensor (the model's `visual.` prefix removed)."""
    if name in _VISION_TOP:
        return _VISION_TOP[name]
    match = _VISION_BLOCK_NAME.fullmatch(name)
    if match is None or match[2] not in _VISION_BLOCK:
        raise NoHFName(name)
    return f"model.vision_tower.layers.{match[1]}.{_VISION_BLOCK[match[2]]}.{match[3]}"
