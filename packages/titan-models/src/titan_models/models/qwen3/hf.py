"""Qwen3ForCausalLM and Qwen3MoeForCausalLM <-> Qwen3Config.

transformers 5.x holds Qwen3-MoE experts fused in memory (gate_up_proj [E, 2*ffn, dim]) but
reads and writes them per expert on disk (`mlp.experts.{e}.{gate,up,down}_proj.weight`), as the
published checkpoints are; that on-disk form is what is read and written here.
"""
from __future__ import annotations

from typing import Any

from titan_models.components.moe import MoEConfig
from titan_models.components.norms import RMSNormConfig
from titan_models.hf.converter import Converter, dtype_name, require, rms_eps
from titan_models.hf.names import DENSE_LAYER, MOE, QK_NORM, hf_names
from titan_models.hf.rope_config import read_rope, write_rope
from titan_models.models.qwen3.model import Qwen3Config

_LAYER_MAP = DENSE_LAYER | QK_NORM | MOE


class Qwen3Converter(Converter):
    architectures = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    config_type = Qwen3Config

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Qwen3Config:
        require(hf, "hidden_act", ("silu",), "silu")
        require(hf, "attention_bias", (False,), False)
        require(hf, "use_sliding_window", (False,), False)
        layer_types = hf.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config.json field layer_types={layer_types} is not supported; supported: full_attention only")
        theta, _ = read_rope(hf, allowed=())
        heads = hf["num_attention_heads"]
        moe = None
        if "Qwen3MoeForCausalLM" in hf.get("architectures", []):
            experts = hf.get("num_experts", hf.get("num_local_experts"))
            moe = MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"],
                            expert_dim=hf["moe_intermediate_size"], score_func="softmax",
                            norm_topk_prob=hf.get("norm_topk_prob", False))
        return Qwen3Config(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_dim=hf["intermediate_size"],
            moe=moe, moe_every=hf.get("decoder_sparse_step", 1), dense_layers=tuple(hf.get("mlp_only_layers") or ()),
            norm=RMSNormConfig(eps=hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_seq_len=hf.get("max_position_embeddings", 32768), tie_embeddings=hf.get("tie_word_embeddings", False))

    def config_to_hf(self, config: Qwen3Config) -> dict[str, Any]:
        hf: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM" if config.moe is None else "Qwen3MoeForCausalLM"],
            "model_type": "qwen3" if config.moe is None else "qwen3_moe",
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_dim,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": rms_eps(config),
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "use_sliding_window": False,
            **write_rope(config.rope_theta, None), "dtype": dtype_name(config.dtype),
        }
        if config.moe is not None:
            moe = config.moe
            if moe.score_func != "softmax" or moe.shared_width or moe.n_group > 1 or moe.route_scale != 1.0:
                raise ValueError(f"Qwen3MoeForCausalLM routes by softmax top-k without shared experts, groups or "
                                 f"scaling; this MoE config cannot be written: {moe}")
            hf |= {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                   "moe_intermediate_size": moe.expert_dim, "norm_topk_prob": moe.norm_topk_prob,
                   "decoder_sparse_step": config.moe_every, "mlp_only_layers": list(config.dense_layers)}
        return hf

    def hf_names(self, config: Qwen3Config, name: str) -> list[str]:
        if name.endswith(".moe.expert_bias"):
            return []  # Qwen3-MoE has no selection bias on disk: it loads as zero
        return hf_names(name, _LAYER_MAP, num_experts=config.moe.num_experts if config.moe else 0)


_TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# Tiny random checkpoints for the registry-driven parity tests (case id -> config.json fields).
TINY_HF_CONFIGS = {
    "dense-tied": _TINY | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": True},
    "moe-dense-layer0": _TINY | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [0]},
}
