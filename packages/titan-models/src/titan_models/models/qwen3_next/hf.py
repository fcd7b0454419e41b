"""Qwen3NextForCausalLM <-> Qwen3NextConfig.

Names as Qwen3.5's (models/qwen3_5/hf.py) except the Gated DeltaNet input projections, fused per key
head: `in_proj_qkvz` holds, for each key head h in turn, [q_h (dk) | k_h (dk) | v of its r = Hv/Hk
value heads (r*dv) | z of those (r*dv)], and `in_proj_ba` [b of its r value heads | a of them].
Titan's wq/wk/wv/wz/wb/wa are those rows gathered (`Rows`), so they shard by heads like attention.
"""
from __future__ import annotations

from typing import Any

from titan_models.hf.converter import HFSource, Rows
from titan_models.hf.names import NoHFName
from titan_models.models.qwen3_5.hf import HybridConverter, read_hybrid_fields, write_hybrid_fields
from titan_models.models.qwen3_next.flavors import qwen3_next_moe
from titan_models.models.qwen3_next.model import Qwen3NextConfig


def grouped_rows(config: Qwen3NextConfig, part: str) -> tuple[int, ...]:
    """Row indices of titan projection `part` (wq, wk, wv, wz in in_proj_qkvz; wb, wa in in_proj_ba)."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    groups = config.linear_num_key_heads
    r = config.linear_num_value_heads // groups
    if part in ("wb", "wa"):
        width, offset, size = 2 * r, (0 if part == "wb" else r), r
    else:
        width = 2 * dk + 2 * r * dv
        offset, size = {"wq": (0, dk), "wk": (dk, dk), "wv": (2 * dk, r * dv), "wz": (2 * dk + r * dv, r * dv)}[part]
    return tuple(g * width + offset + i for g in range(groups) for i in range(size))


class Qwen3NextConverter(HybridConverter):
    architectures = ("Qwen3NextForCausalLM",)
    config_type = Qwen3NextConfig

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Qwen3NextConfig:
        moe = qwen3_next_moe(experts=hf.get("num_experts") or 512, top_k=hf.get("num_experts_per_tok", 10),
                             expert_dim=hf.get("moe_intermediate_size", 512),
                             shared_dim=hf.get("shared_expert_intermediate_size", 512),
                             norm_topk_prob=hf.get("norm_topk_prob", True))
        return Qwen3NextConfig(**read_hybrid_fields(hf), ffn_dim=hf.get("intermediate_size", 5632), moe=moe,
                               moe_every=hf.get("decoder_sparse_step", 1),
                               dense_layers=tuple(hf.get("mlp_only_layers") or ()),
                               tie_embeddings=hf.get("tie_word_embeddings", False))

    def config_to_hf(self, config: Qwen3NextConfig) -> dict[str, Any]:
        hf = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **write_hybrid_fields(config),
              "intermediate_size": config.ffn_dim, "decoder_sparse_step": config.moe_every,
              "mlp_only_layers": list(config.dense_layers)}
        moe = config.moe
        if moe is None:
            raise ValueError("Qwen3NextForCausalLM is a MoE model; this Qwen3NextConfig has moe=None")
        if (moe.score_func != "softmax" or not moe.shared_expert_gate or not moe.shared_width or moe.n_group > 1
                or moe.route_scale != 1.0):
            raise ValueError("Qwen3NextForCausalLM routes by softmax top-k with one gated shared expert; this MoE "
                             f"config cannot be written: {moe}")
        return hf | {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                     "moe_intermediate_size": moe.expert_dim, "shared_expert_intermediate_size": moe.shared_width,
                     "norm_topk_prob": moe.norm_topk_prob}

    def linear_names(self, config: Qwen3NextConfig, rest: str, prefix: str) -> list[HFSource]:
        module, _, _ = rest.removeprefix("attention.").partition(".")
        if module in ("wq", "wk", "wv", "wz"):
            return [Rows(prefix + "linear_attn.in_proj_qkvz.weight", grouped_rows(config, module))]
        if module in ("wb", "wa"):
            return [Rows(prefix + "linear_attn.in_proj_ba.weight", grouped_rows(config, module))]
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        spans = {"q_conv": (0, key_dim), "k_conv": (key_dim, 2 * key_dim),
                 "v_conv": (2 * key_dim, 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim)}
        if module in spans:
            return [Rows.span(prefix + "linear_attn.conv1d.weight", *spans[module])]
        raise NoHFName(prefix + rest)

    def reported(self, config: Qwen3NextConfig, hf_name: str) -> bool:
        return hf_name.startswith("mtp.")  # the released checkpoints' MTP head


_TINY = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 8, "linear_value_head_dim": 12, "max_position_embeddings": 256,
         "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
         "num_experts": 8, "num_experts_per_tok": 2}
TINY_HF_CONFIGS = {
    "moe-raw-dense-layer0": _TINY | {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                                     "norm_topk_prob": False, "mlp_only_layers": [0]},
    "moe-tied-3v": _TINY | {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                            "linear_num_value_heads": 6, "tie_word_embeddings": True},
}
