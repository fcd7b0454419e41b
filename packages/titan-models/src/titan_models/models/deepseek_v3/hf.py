"""DeepseekV3ForCausalLM <-> DeepSeekV3Config.

The MTP module, which transformers does not run, is stored as DeepSeek's released checkpoints
store it: as decoder layer `num_hidden_layers` (`enorm`, `hnorm`, `eh_proj`, the block's usual
tensors, `shared_head.norm`), plus copies of the embedding (`embed_tokens`) and output
(`shared_head.head`). `from_hf` builds the MTP module when those tensors are present.

Kimi K2.x (`Kimi_K25ForConditionalGeneration`, model type `kimi_k25`) is this text model inside an
image-text checkpoint; its family (titan_models.models.kimi_k25) converts it with a subclass of this
converter, which reads the text part through the Kimi branches here: the decoder under
`language_model.model.layers.*` and the head as `language_model.lm_head.weight` (the release layout;
transformers 5.20's `save_pretrained` writes `language_model.model.blocks.*`, reversing its vision
`blocks -> layers` rename on every name: both load), the text settings in `text_config`. The head is tied
as transformers resolves it: by the top-level `tie_word_embeddings` (default True), whatever `text_config`
says, except that a checkpoint storing its own head keeps it (transformers declines to tie an embedding and
a head both present with different values; equal values give the same logits either way).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from titan_models.components.moe import MoEConfig
from titan_models.components.norms import RMSNormConfig
from titan_models.hf.converter import Converter, dtype_name, require, rms_eps
from titan_models.hf.names import DENSE_LAYER, MLA, MOE, NoHFName, hf_names, layer_names
from titan_models.hf.rope_config import read_rope, write_rope
from titan_models.models.deepseek_v3.model import DeepSeekV3Config

_LAYER_MAP = {k: v for k, v in DENSE_LAYER.items() if not k.startswith("attention.")} | MLA | MOE | {
    "moe.expert_bias": "mlp.gate.e_score_correction_bias"}
_MTP_OWN = {"mtp.enorm.weight": "enorm.weight", "mtp.hnorm.weight": "hnorm.weight",
            "mtp.eh_proj.weight": "eh_proj.weight", "mtp.norm.weight": "shared_head.norm.weight"}
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


_KIMI_K25 = "Kimi_K25ForConditionalGeneration"
# where a Kimi K2.x checkpoint keeps the causal-LM names, by the prefix its decoder is found under
_KIMI_LAYOUTS = (("language_model.model.layers.", {"model.": "language_model.model.",
                                                   "lm_head.": "language_model.lm_head."}),
                 ("language_model.model.blocks.", {"model.layers.": "language_model.model.blocks.",
                                                   "model.": "language_model.model.",
                                                   "lm_head.": "language_model.lm_head."}))


def _is_kimi(hf: dict[str, Any]) -> bool:
    return _KIMI_K25 in (hf.get("architectures") or []) or hf.get("model_type") == "kimi_k25"


class DeepSeekV3Converter(Converter):
    architectures = ("DeepseekV3ForCausalLM",)
    config_type = DeepSeekV3Config

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> DeepSeekV3Config:
        if not _is_kimi(hf):
            return self._text_config(hf, tensor_names, tie=hf.get("tie_word_embeddings", False))
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("config.json field text_config is missing: a kimi_k25 checkpoint keeps its text "
                             "model's settings there")
        require(text, "model_type", ("deepseek_v3", "kimi_k2"), "deepseek_v3")
        # Kimi_K25Config.tie_word_embeddings (default True) decides, whatever text_config says, unless a head is stored
        names = {n.removeprefix("language_model.").replace("model.blocks.", "model.layers.", 1) for n in tensor_names}
        tie = hf.get("tie_word_embeddings", True) and "lm_head.weight" not in names
        return self._text_config(text, names, tie=tie)

    def _text_config(self, hf: dict[str, Any], tensor_names: set[str], *, tie: bool) -> DeepSeekV3Config:
        require(hf, "hidden_act", ("silu",), "silu")
        require(hf, "attention_bias", (False,), False)
        require(hf, "scoring_func", ("sigmoid",), "sigmoid")  # DeepSeek's own config spelling
        require(hf, "moe_layer_freq", (1,), 1)
        theta, scaling = read_rope(hf, allowed=("yarn",))
        layers = hf["num_hidden_layers"]
        mtp_layers = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
        has_mtp_tensors = any(n.startswith(f"model.layers.{layers}.") for n in tensor_names)
        if has_mtp_tensors and mtp_layers > 1:
            raise ValueError(f"config.json field num_nextn_predict_layers={mtp_layers} is not supported; supported: 0, 1")
        moe = MoEConfig(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                        expert_dim=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
                        score_func="sigmoid", n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                        norm_topk_prob=hf.get("norm_topk_prob", True), route_scale=hf.get("routed_scaling_factor", 1.0))
        return DeepSeekV3Config(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=layers,
            num_heads=hf["num_attention_heads"], ffn_dim=hf["intermediate_size"],
            first_k_dense=hf.get("first_k_dense_replace", 0), moe=moe, q_lora_rank=hf.get("q_lora_rank") or None,
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            norm=RMSNormConfig(eps=hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            rope_interleave=hf.get("rope_interleave", True), max_seq_len=hf.get("max_position_embeddings", 4096),
            mtp=has_mtp_tensors and mtp_layers >= 1, tie_embeddings=tie)

    def config_to_hf(self, config: DeepSeekV3Config) -> dict[str, Any]:
        moe = config.moe
        if moe.score_func != "sigmoid":
            raise ValueError(f"DeepseekV3ForCausalLM routes with sigmoid scores; this config uses {moe.score_func!r}")
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_dim,
            "moe_intermediate_size": moe.expert_dim, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_heads,
            "n_shared_experts": moe.num_shared_experts, "n_routed_experts": moe.num_experts,
            "routed_scaling_factor": moe.route_scale, "kv_lora_rank": config.kv_lora_rank,
            "q_lora_rank": config.q_lora_rank, "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim, "qk_nope_head_dim": config.qk_nope_head_dim,
            "n_group": moe.n_group, "topk_group": moe.topk_group, "num_experts_per_tok": moe.top_k,
            "first_k_dense_replace": config.first_k_dense, "norm_topk_prob": moe.norm_topk_prob,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
            "num_nextn_predict_layers": 1 if config.mtp else 0, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": rms_eps(config),
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
            "rope_interleave": config.rope_interleave, **write_rope(config.rope_theta, config.rope_scaling),
            "dtype": dtype_name(config.dtype),
        }

    def hf_names(self, config: DeepSeekV3Config, name: str) -> list[str]:
        experts = config.moe.num_experts
        if not name.startswith("mtp."):
            return hf_names(name, _LAYER_MAP, num_experts=experts)
        prefix = f"model.layers.{config.num_layers}."
        if name in _MTP_OWN:
            return [prefix + _MTP_OWN[name]]
        if name.startswith("mtp.layer."):
            try:
                return layer_names(name.removeprefix("mtp.layer."), prefix, _LAYER_MAP, experts)
            except NoHFName:
                raise NoHFName(name) from None
        raise NoHFName(name)

    def checkpoint_prefixes(self, tensor_names: set[str]) -> dict[str, str]:
        for marker, prefixes in _KIMI_LAYOUTS:
            if any(n.startswith(marker) for n in tensor_names):
                return prefixes
        return super().checkpoint_prefixes(tensor_names)

    def ignorable(self, config: DeepSeekV3Config, hf_name: str) -> bool:
        # The MTP layer's copies of the embedding and output duplicate the main model's.
        copies = "|".join(re.escape(c) for c in _MTP_COPIES)
        mtp_copy = config.mtp and re.fullmatch(rf"model\.layers\.{config.num_layers}\.({copies})", hf_name)
        return bool(mtp_copy) or super().ignorable(config, hf_name)

    def extra_tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        if getattr(model, "mtp", None) is None:
            return []
        prefix = f"model.layers.{model.config.num_layers}."
        return [(prefix + "embed_tokens.weight", model.tok_embeddings.weight),
                (prefix + "shared_head.head.weight", model.output.weight)]


_TINY = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 128,
         "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
         "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 12, "n_group": 1, "topk_group": 1, "max_position_embeddings": 256}
# Tiny random checkpoints for the registry-driven parity tests (case id -> config.json fields).
TINY_HF_CONFIGS = {
    "kv-lora-interleaved": _TINY | {"q_lora_rank": None, "rope_interleave": True,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "q-lora-yarn-groups": _TINY | {"q_lora_rank": 24, "rope_interleave": False, "n_group": 4, "topk_group": 2,
                                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
}
