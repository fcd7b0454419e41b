"""LlamaForCausalLM <-> Llama3Config."""
from __future__ import annotations

from typing import Any

from titan_models.components.norms import RMSNormConfig
from titan_models.hf.converter import Converter, dtype_name, require, rms_eps
from titan_models.hf.names import DENSE_LAYER, hf_names
from titan_models.hf.rope_config import read_rope, write_rope
from titan_models.models.llama3.model import Llama3Config


class Llama3Converter(Converter):
    architectures = ("LlamaForCausalLM",)
    config_type = Llama3Config

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Llama3Config:
        require(hf, "hidden_act", ("silu",), "silu")
        require(hf, "attention_bias", (False,), False)
        require(hf, "mlp_bias", (False,), False)
        theta, scaling = read_rope(hf, allowed=("llama3",))
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return Llama3Config(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_dim=hf["intermediate_size"], head_dim=head_dim,
            norm=RMSNormConfig(eps=hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            tie_embeddings=hf.get("tie_word_embeddings", False))

    def config_to_hf(self, config: Llama3Config) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": config.vocab_size, "hidden_size": config.dim,
            "intermediate_size": config.ffn_dim, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.resolved_head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": rms_eps(config),
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            **write_rope(config.rope_theta, config.rope_scaling), "dtype": dtype_name(config.dtype),
        }

    def hf_names(self, config: Llama3Config, name: str) -> list[str]:
        return hf_names(name, DENSE_LAYER)


_TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
# Tiny random checkpoints the registry-driven parity tests build with transformers (case id -> config.json
# fields). The Llama 3 RoPE case's original context (8) is shorter than the test sequences, so every
# branch of its frequency rule is exercised.
TINY_HF_CONFIGS = {
    "gqa": _TINY | {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
    "llama3-rope-tied": _TINY | {"num_key_value_heads": 1, "tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
}
