"""Qwen3.5 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and the composite `...ForConditionalGeneration`
checkpoints) <-> Qwen3_5Config.

Gated DeltaNet layers store `linear_attn.in_proj_qkv` ([q | k | v] rows, every key head then every
value head), `in_proj_z`, `in_proj_b`, `in_proj_a`, one `conv1d.weight` over the [q | k | v] channels,
`A_log`, `dt_bias`, `norm` and `out_proj`: titan's wq/wk/wv and q/k/v convs are row ranges of the fused
tensors (`Rows`). Gated attention layers store `self_attn.q_proj` with each head's [query | gate]
rows, as titan does. MoE experts are stored per expert (`mlp.experts.{e}.*`), the shared expert as
`mlp.shared_expert.*` and its gate as `mlp.shared_expert_gate`.

Composite checkpoints (the published ones) nest the decoder under `model.language_model.` beside
`model.visual.*` (the vision tower) and `mtp.*` (the multi-token-prediction head) and keep the text
settings in `text_config`: the text model loads and from_hf lists the tensors it leaves in a warning.
`to_hf` writes the text-only causal-LM form.
"""
from __future__ import annotations

import re
from typing import Any

from titan_models.components.layer_types import LINEAR_ATTENTION
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import ZeroCenteredRMSNormConfig
from titan_models.hf.converter import Converter, HFSource, Rows, check_field_types, dtype_name, require
from titan_models.hf.names import DENSE_LAYER, QK_NORM, NoHFName, layer_names
from titan_models.hf.rope_config import read_rope
from titan_models.models.qwen3_5.model import LAYER_TYPES, HybridConfig, Qwen3_5Config
from titan_models.registry import TinyHFCase

_COMMON = DENSE_LAYER | QK_NORM | {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
_LINEAR = {"attention.decay.A_log": "linear_attn.A_log", "attention.decay.dt_bias": "linear_attn.dt_bias",
           "attention.norm.weight": "linear_attn.norm.weight", "attention.wo.weight": "linear_attn.out_proj.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def read_hybrid_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The HybridConfig fields both Qwen3.5 and Qwen3-Next configs spell the same way."""
    require(text, "hidden_act", ("silu",), "silu")
    require(text, "attention_bias", (False,), False)
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta, _ = read_rope(text, allowed=())
    layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is not None:
        layer_types = tuple(layer_types)
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"config.json field layer_types has unknown entries {bad}; allowed: {list(LAYER_TYPES)}")
        if len(layer_types) != layers:
            raise ValueError(f"config.json field layer_types has {len(layer_types)} entries for "
                             f"num_hidden_layers={layers}")
    heads = text["num_attention_heads"]
    return dict(
        vocab_size=text["vocab_size"], dim=text["hidden_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        linear_num_key_heads=text.get("linear_num_key_heads", 16),
        linear_num_value_heads=text.get("linear_num_value_heads", 32),
        linear_key_head_dim=text.get("linear_key_head_dim", 128),
        linear_value_head_dim=text.get("linear_value_head_dim", 128),
        linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
        layer_types=layer_types, full_attention_interval=text.get("full_attention_interval", 4),
        partial_rotary_factor=float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        norm=ZeroCenteredRMSNormConfig(eps=text.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_seq_len=text.get("max_position_embeddings", 32768))


def write_hybrid_fields(config: HybridConfig) -> dict[str, Any]:
    if not isinstance(config.norm, ZeroCenteredRMSNormConfig):
        raise ValueError(f"Hugging Face {config.family} models use zero-centred RMSNorm; this config has {config.norm}")
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "attention_bias": False,
        "linear_num_key_heads": config.linear_num_key_heads, "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim, "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel, "layer_types": list(config.layer_kinds()),
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm.eps,
        "tie_word_embeddings": config.tie_embeddings, "dtype": dtype_name(config.dtype),
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
    }


class HybridConverter(Converter):
    """Name mapping shared by Qwen3.5 and Qwen3-Next; `linear_names` gives the Gated DeltaNet layout."""

    def linear_names(self, config: HybridConfig, rest: str, prefix: str) -> list[HFSource]:
        raise NotImplementedError

    def hf_names(self, config: HybridConfig, name: str) -> list[HFSource]:
        if name in _TOP_LEVEL:
            return [_TOP_LEVEL[name]]
        match = _LAYER.fullmatch(name)
        if match is None:
            raise NoHFName(name)
        layer, rest = int(match[1]), match[2]
        prefix = f"model.layers.{layer}."
        if rest.endswith("moe.expert_bias"):
            return []  # no selection bias on disk: loads as zero
        if config.layer_kinds()[layer] == LINEAR_ATTENTION and rest.startswith("attention."):
            if rest in _LINEAR:
                return [prefix + _LINEAR[rest]]
            return self.linear_names(config, rest, prefix)
        try:
            return layer_names(rest, prefix, _COMMON, config.moe.num_experts if config.moe else 0)
        except NoHFName:
            raise NoHFName(name) from None


class Qwen3_5Converter(HybridConverter):
    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                     "Qwen3_5MoeForConditionalGeneration")
    config_type = Qwen3_5Config

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Qwen3_5Config:
        text = hf.get("text_config") or hf
        if text is not hf:  # a composite checkpoint: its text settings are checked like a top-level config
            check_field_types(text, "config.json field text_config")
        moe = None
        if any("Moe" in arch for arch in hf.get("architectures", [])):
            moe = MoEConfig(num_experts=text["num_experts"], top_k=text["num_experts_per_tok"],
                            expert_dim=text["moe_intermediate_size"], score_func="softmax", norm_topk_prob=True,
                            shared_expert_dim=text["shared_expert_intermediate_size"], shared_expert_gate=True)
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return Qwen3_5Config(**read_hybrid_fields(text), ffn_dim=0 if moe else text["intermediate_size"], moe=moe,
                             tie_embeddings=tie)

    def config_to_hf(self, config: Qwen3_5Config) -> dict[str, Any]:
        if config.dense_layers or config.moe_every != 1:
            raise ValueError("Qwen3.5 MoE models have MoE in every layer; dense_layers/moe_every cannot be written")
        hf = write_hybrid_fields(config)
        if config.moe is None:
            return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                    "intermediate_size": config.ffn_dim, **hf}
        moe = config.moe
        if (moe.score_func != "softmax" or not moe.norm_topk_prob or not moe.shared_expert_gate or moe.n_group > 1
                or moe.route_scale != 1.0 or not moe.shared_width):
            raise ValueError("Qwen3_5MoeForCausalLM routes by renormalised softmax top-k with one gated shared "
                             f"expert; this MoE config cannot be written: {moe}")
        return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **hf,
                "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.expert_dim, "shared_expert_intermediate_size": moe.shared_width}

    def linear_names(self, config: HybridConfig, rest: str, prefix: str) -> list[HFSource]:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        spans = {"wq": (0, key_dim), "wk": (key_dim, 2 * key_dim), "wv": (2 * key_dim, 2 * key_dim + value_dim)}
        module, _, _ = rest.removeprefix("attention.").partition(".")
        if module in spans:
            return [Rows.span(prefix + "linear_attn.in_proj_qkv.weight", *spans[module])]
        if module in ("q_conv", "k_conv", "v_conv"):
            return [Rows.span(prefix + "linear_attn.conv1d.weight", *spans["w" + module[0]])]
        plain = {"wz": "in_proj_z", "wb": "in_proj_b", "wa": "in_proj_a"}
        if module in plain:
            return [prefix + f"linear_attn.{plain[module]}.weight"]
        raise NoHFName(prefix + rest)

    def text_prefix(self, tensor_names: set[str]) -> str:
        composite = any(n.startswith("model.language_model.") for n in tensor_names)
        return "model.language_model." if composite else "model."

    def reported(self, config: Qwen3_5Config, hf_name: str) -> bool:
        return hf_name.startswith(("model.visual.", "mtp."))


_TINY = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 8, "linear_value_head_dim": 12, "max_position_embeddings": 256}
_DENSE = _TINY | {"intermediate_size": 96}
_MOE = _TINY | {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 8,
                "num_experts_per_tok": 2}
# A one-block vision tower whose merged output width is the text width; image token ids inside the vocabulary.
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
           "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}
_IMAGE_TOKENS = {"image_token_id": 120, "video_token_id": 121, "vision_start_token_id": 122,
                 "vision_end_token_id": 123}


def _composite(model_type: str, architecture: str, text: dict[str, Any], written_as: str) -> TinyHFCase:
    return TinyHFCase(config={"model_type": model_type, "architectures": [architecture], "text_config": text,
                              "vision_config": _VISION, **_IMAGE_TOKENS},
                      auto_class="AutoModelForImageTextToText", written_as=written_as)


TINY_HF_CONFIGS = {
    "dense": _DENSE | {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]},
    "moe-tied": _MOE | {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                        "tie_word_embeddings": True},
    # the published form: text model under model.language_model beside model.visual (to_hf writes the text form)
    "composite-dense": _composite("qwen3_5", "Qwen3_5ForConditionalGeneration", _DENSE, "Qwen3_5ForCausalLM"),
    "composite-moe": _composite("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", _MOE, "Qwen3_5MoeForCausalLM"),
}
