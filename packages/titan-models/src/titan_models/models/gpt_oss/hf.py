"""GptOssForCausalLM <-> GptOssConfig.

Experts on disk: `gate_up_proj` [E, dim, 2 * ffn] applied as x @ W with the gate in columns ::2 and
the up projection in 1::2, `gate_up_proj_bias` [E, 2 * ffn], `down_proj` [E, ffn, dim] (x @ W),
`down_proj_bias` [E, dim]. titan keeps Linear-style w1/w3 [E, ffn, dim] and w2 [E, dim, ffn].
The published checkpoints store the expert matrices in MXFP4 (`gate_up_proj_blocks`/`_scales`,
`down_proj_blocks`/`_scales`, [E, rows, dim / 32, 16] and [E, rows, dim / 32] with rows the output
features): they are dequantized on load (hf/mxfp4.py) and written back in the plain layout.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from titan_models.components.ffn import ClampedSwiGLU
from titan_models.components.norms import RMSNormConfig
from titan_models.hf.converter import Converter, dtype_name, require, rms_eps
from titan_models.hf.mxfp4 import BLOCK, dequantize_mxfp4
from titan_models.hf.names import NoHFName
from titan_models.hf.rope_config import read_rope, write_rope
from titan_models.models.gpt_oss.model import LAYER_TYPES, GptOssConfig, gpt_oss_moe

_LAYER_MAP = {
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.sinks.weight": "self_attn.sinks",
    **{f"attention.{ours}.{kind}": f"self_attn.{theirs}_proj.{kind}"
       for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")) for kind in ("weight", "bias")},
    "moe.router.gate.weight": "mlp.router.weight", "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.w1": "mlp.experts.gate_up_proj", "moe.experts.w3": "mlp.experts.gate_up_proj",
    "moe.experts.w1_bias": "mlp.experts.gate_up_proj_bias", "moe.experts.w3_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.w2": "mlp.experts.down_proj", "moe.experts.w2_bias": "mlp.experts.down_proj_bias",
}
_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_GATE_UP = {"w1": 0, "w3": 1, "w1_bias": 0, "w3_bias": 1}  # column offset in the interleaved gate_up


class GptOssConverter(Converter):
    architectures = ("GptOssForCausalLM",)
    config_type = GptOssConfig

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> GptOssConfig:
        require(hf, "hidden_act", ("silu",), "silu")
        require(hf, "attention_bias", (True,), True)
        quant = (hf.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise ValueError(f"config.json field quantization_config.quant_method={quant!r} is not supported; "
                             "supported: none, 'mxfp4' (dequantized on load)")
        theta, scaling = read_rope(hf, allowed=("yarn",))
        layers = hf["num_hidden_layers"]
        layer_types = tuple(hf.get("layer_types") or (LAYER_TYPES[i % 2] for i in range(layers)))
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"config.json field layer_types holds {unknown}; supported: {list(LAYER_TYPES)}")
        heads = hf["num_attention_heads"]
        moe = gpt_oss_moe(num_experts=hf.get("num_local_experts", hf.get("num_experts")),
                          top_k=hf.get("num_experts_per_tok", hf.get("experts_per_token")),
                          expert_dim=hf["intermediate_size"], swiglu_limit=hf.get("swiglu_limit", 7.0),
                          swiglu_alpha=hf.get("swiglu_alpha", 1.702))
        return GptOssConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=layers, num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            moe=moe, layer_types=layer_types, sliding_window=hf.get("sliding_window") or 128,
            norm=RMSNormConfig(eps=hf.get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
            max_seq_len=hf.get("max_position_embeddings", 131072), tie_embeddings=hf.get("tie_word_embeddings", False))

    def config_to_hf(self, config: GptOssConfig) -> dict[str, Any]:
        moe = config.moe
        act = moe.activation
        if (moe.score_func != "topk_softmax" or not (moe.router_bias and moe.expert_linear_bias)
                or not isinstance(act, ClampedSwiGLU) or act.up_shift != 1.0 or moe.num_shared_experts
                or moe.route_scale != 1.0):
            raise ValueError(f"GptOssForCausalLM routes by softmax over the top-k biased logits into clamped-SwiGLU "
                             f"experts with biases (gpt_oss_moe); this MoE config cannot be written: {moe}")
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": moe.expert_dim,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "swiglu_limit": act.limit, "swiglu_alpha": act.alpha, "attention_bias": True,
            "layer_types": list(config.resolved_layer_types), "sliding_window": config.sliding_window,
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": rms_eps(config),
            "tie_word_embeddings": config.tie_embeddings,
            **write_rope(config.rope_theta, config.rope_scaling), "dtype": dtype_name(config.dtype),
        }

    def hf_names(self, config: GptOssConfig, name: str) -> list[str]:
        if name in _TOP_LEVEL:
            return [_TOP_LEVEL[name]]
        match = _LAYER.fullmatch(name)
        if match is None:
            raise NoHFName(name)
        if match[2] == "moe.expert_bias":
            return []  # gpt-oss has no selection bias on disk: it loads as zero
        if match[2] not in _LAYER_MAP:
            raise NoHFName(name)
        return [f"model.layers.{match[1]}.{_LAYER_MAP[match[2]]}"]

    @staticmethod
    def _expert(name: str) -> str | None:
        """'w1', 'w3_bias', ... for a routed-expert tensor, else None."""
        return name.rpartition(".")[2] if ".moe.experts." in name else None

    def disk_layout(self, config: GptOssConfig, name: str, shape: tuple[int, ...], present: set[str]
                    ) -> dict[str, tuple[int, ...]] | None:
        expert = self._expert(name)
        if expert is None:
            return None  # hf_names' one-to-one layout
        (hf_name,) = self.hf_names(config, name)
        e, ffn, dim = config.moe.num_experts, config.moe.expert_dim, config.dim
        if expert in ("w1", "w3", "w2") and hf_name not in present and hf_name + "_blocks" in present:
            rows, cols = (2 * ffn, dim) if expert != "w2" else (dim, ffn)  # MXFP4 keeps output rows
            if cols % BLOCK:
                raise ValueError(f"{hf_name}_blocks: MXFP4 needs the input width {cols} to be a multiple of {BLOCK}")
            return {hf_name + "_blocks": (e, rows, cols // BLOCK, BLOCK // 2), hf_name + "_scales": (e, rows, cols // BLOCK)}
        disk = {"w1": (e, dim, 2 * ffn), "w3": (e, dim, 2 * ffn), "w2": (e, ffn, dim),
                "w1_bias": (e, 2 * ffn), "w3_bias": (e, 2 * ffn), "w2_bias": (e, dim)}
        return {hf_name: disk[expert]}

    def load(self, config: GptOssConfig, name: str, files: Any, present: set[str]) -> torch.Tensor | None:
        expert = self._expert(name)
        (hf_name,) = self.hf_names(config, name)
        if expert in ("w1", "w3", "w2") and hf_name not in present:  # MXFP4: [E, rows, cols] -> x @ W layout
            fused = dequantize_mxfp4(files.get(hf_name + "_blocks"), files.get(hf_name + "_scales")).transpose(1, 2)
        else:
            fused = files.get(hf_name)
        if expert in _GATE_UP:
            fused = fused[..., _GATE_UP[expert]::2]  # [E, dim, ffn] or [E, ffn]
        return fused.transpose(1, 2) if expert in ("w1", "w3", "w2") else fused

    def to_hf_tensor(self, config: GptOssConfig, hf_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        by_kind = {self._expert(n): t for n, t in parts.items()}
        if "w2" in by_kind:
            return by_kind["w2"].transpose(1, 2)
        if "w2_bias" in by_kind:
            return by_kind["w2_bias"]
        gate, up = (by_kind["w1"], by_kind["w3"]) if "w1" in by_kind else (by_kind["w1_bias"], by_kind["w3_bias"])
        if gate.dim() == 3:  # [E, ffn, dim] -> [E, dim, ffn]
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)
        return torch.stack([gate, up], dim=-1).flatten(-2)  # columns gate0, up0, gate1, up1, ...


# Tiny random checkpoints for the registry-driven parity tests (case id -> config.json fields): 80-token
# tests see windows of 8 keys, sinks and routing.
_TINY = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 4096}
TINY_HF_CONFIGS = {
    "alternating-yarn": _TINY,
    "full-then-sliding": _TINY | {"layer_types": ["full_attention", "sliding_attention"],
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}
