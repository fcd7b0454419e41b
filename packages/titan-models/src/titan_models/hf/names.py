"""Parameter names: titan (docs/conventions.md) <-> Hugging Face, per decoder layer.

Stacked expert weights map to one Hugging Face tensor per expert (what transformers 5.x writes
on disk and loads: `mlp.experts.{e}.{gate,up,down}_proj.weight`).
"""
from __future__ import annotations

import re

# titan name inside a layer -> Hugging Face name inside `model.layers.N.`
DENSE_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
QK_NORM = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
# stacked titan expert weight -> per-expert Hugging Face name pattern
EXPERTS = {
    "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "moe.experts.w3": "mlp.experts.{e}.up_proj.weight",
}
TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class NoHFName(ValueError):
    """A titan tensor the Hugging Face architecture has no place for."""


def layer_names(rest: str, hf_prefix: str, layer_map: dict[str, str], num_experts: int) -> list[str]:
    if rest in EXPERTS:
        return [hf_prefix + EXPERTS[rest].format(e=e) for e in range(num_experts)]
    if rest not in layer_map:
        raise NoHFName(rest)
    return [hf_prefix + layer_map[rest]]


def hf_names(name: str, layer_map: dict[str, str], *, num_experts: int = 0) -> list[str]:
    """Hugging Face names holding titan tensor `name`: one, or one per expert (stacked on dim 0)."""
    if name in TOP_LEVEL:
        return [TOP_LEVEL[name]]
    match = _LAYER.fullmatch(name)
    if match is None:
        raise NoHFName(name)
    try:
        return layer_names(match[2], f"model.layers.{match[1]}.", layer_map, num_experts)
    except NoHFName:
        raise NoHFName(name) from None
