"""DeepseekV4ForCausalLM <-> DeepSeekV4Config, in both layouts on disk.

transformers writes DeepSeek's own tensor names under `model.` (`model.layers.N.attn.{wq_a,q_norm,wq_b,wkv,
norm,wo_a,wo_b,attn_sink}`, `...attn.compressor.{wkv,wgate,ape,norm}`, `...attn.indexer.{wq_b,weights_proj,
compressor.*}`, `...ffn.gate.{weight,bias,tid2eid}`, `...ffn.experts.E.w1/w2/w3`, `...hc_attn_*`, `...hc_ffn_*`,
`model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_*`, `head.weight`); DeepSeek's release
has the same names without the prefix, with `embed.weight`, `norm.weight`, `hc_head_{fn,base,scale}` at the
top. The MTP module is DeepSeek's `mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_{fn,base,scale}}` with a block
under the layers' names (`mtp.0.attn.*`, `mtp.0.ffn.*`, `mtp.0.hc_attn_*`, ...); transformers drops `mtp.*` on
load, so to_hf writes it as `model.mtp.0.*` beside transformers' layout (read back by from_hf, ignored by
transformers). A checkpoint with MTP tensors builds the module (`mtp=True`) when its config declares
`num_nextn_predict_layers` >= 1. from_hf reads either layout; to_hf writes transformers' layout.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titan_models.components.compressed_attention import ATTENTION_KINDS
from titan_models.hf.converter import Converter, dtype_name, require
from titan_models.hf.names import NoHFName
from titan_models.hf.rope_config import read_rope, write_rope
from titan_models.models.deepseek_v4.model import MLP_KINDS, DeepSeekV4Config, deepseek_v4_moe
from titan_models.registry import TinyHFCase

_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "head.weight", "hc_head.fn": "model.hc_head.hc_fn",
              "hc_head.base": "model.hc_head.hc_base", "hc_head.scale": "model.hc_head.hc_scale"}
_RELEASE_TOP_LEVEL = {"tok_embeddings.weight": "embed.weight", "norm.weight": "norm.weight",
                      "hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"}
_LAYER_MAP = {
    "attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    **{f"{ours}_hc.{p}": f"hc_{theirs}_{p}" for ours, theirs in (("attention", "attn"), ("ffn", "ffn"))
       for p in ("fn", "base", "scale")},
    "attention.kv_norm.weight": "attn.norm.weight", "attention.sinks.weight": "attn.attn_sink",
    "moe.router.gate.weight": "ffn.gate.weight", "moe.tid2eid": "ffn.gate.tid2eid",
    **{f"moe.shared_experts.{w}.weight": f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")},
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP_OWN = {"mtp.enorm.weight": "enorm.weight", "mtp.hnorm.weight": "hnorm.weight", "mtp.e_proj.weight": "e_proj.weight",
            "mtp.h_proj.weight": "h_proj.weight", "mtp.norm.weight": "norm.weight", "mtp.hc_head.fn": "hc_head_fn",
            "mtp.hc_head.base": "hc_head_base", "mtp.hc_head.scale": "hc_head_scale"}
_MTP_NAME = re.compile(r"(?:model\.)?mtp\.(\d+)\..+")


def _read_mtp(hf: dict[str, Any], tensor_names: set[str]) -> bool:
    """Whether to build the MTP module: the checkpoint holds `mtp.0.*` tensors and its config declares them."""
    modules = {int(m[1]) for n in tensor_names if (m := _MTP_NAME.fullmatch(n))}
    declared = hf.get("num_nextn_predict_layers", 0) or 0
    if modules and (modules != {0} or declared > 1):
        raise ValueError(f"config.json field num_nextn_predict_layers={declared} with MTP modules {sorted(modules)} "
                         "is not supported; supported: one module (mtp.0.*) or none")
    return bool(modules) and declared >= 1


def _read_ropes(hf: dict[str, Any], head_dim: int) -> tuple[int, float, float, Any]:
    """(rope_dim, main theta, compress theta, compress scaling) from transformers' nested `rope_parameters`
    ({"main": ..., "compress": ...}) or the release's flat form (YaRN keys belong to the compressed RoPE)."""
    rope = hf.get("rope_parameters") or {}
    if isinstance(rope.get("compress"), dict):
        main, compress = rope.get("main") or {}, rope["compress"]
    else:
        main = {}
        compress = {**(hf.get("rope_scaling") or rope), "rope_theta": hf.get("compress_rope_theta", 160000.0)}
    rotary = main.get("partial_rotary_factor", compress.get("partial_rotary_factor", hf.get("partial_rotary_factor")))
    rope_dim = int(head_dim * rotary) if rotary is not None else hf.get("qk_rope_head_dim", 64)
    main_theta, _ = read_rope({"rope_parameters": {"rope_theta": hf.get("rope_theta", 10000.0), **main}}, allowed=())
    compress_theta, scaling = read_rope({"rope_parameters": compress, "max_position_embeddings":
                                         hf.get("max_position_embeddings", 1048576)}, allowed=("yarn",))
    if scaling is not None and scaling.explicit_attention_factor is None:  # transformers forces 1.0 for V4
        scaling = dataclasses.replace(scaling, explicit_attention_factor=1.0)
    return rope_dim, main_theta, compress_theta, scaling


def _read_schedules(hf: dict[str, Any], layers: int) -> tuple[list[str] | None, list[str]]:
    """(layer_types or None for the default, mlp_layer_types); ValueError naming a malformed field."""
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("compress_ratios") is not None:  # the release's per-layer 0 / 4 / 128
        kind = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        layer_types = [kind[r] for r in hf["compress_ratios"]][:layers]
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        mlp_types = ["hash_moe" if i < hf.get("num_hash_layers", 3) else "moe" for i in range(layers)]
    for field, types, allowed in (("layer_types", layer_types, ATTENTION_KINDS),
                                  ("mlp_layer_types", mlp_types, MLP_KINDS)):
        if types is not None and (len(types) != layers or set(types) - set(allowed)):
            raise ValueError(f"config.json field {field}={types} must have num_hidden_layers={layers} entries "
                             f"from {list(allowed)}")
    return layer_types, mlp_types


class DeepSeekV4Converter(Converter):
    architectures = ("DeepseekV4ForCausalLM",)
    config_type = DeepSeekV4Config

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> DeepSeekV4Config:
        require(hf, "hidden_act", ("silu",), "silu")
        require(hf, "num_key_value_heads", (1,), 1)
        require(hf, "attention_bias", (False,), False)
        layers, head_dim = hf["num_hidden_layers"], hf.get("head_dim", 512)
        rope_dim, main_theta, compress_theta, scaling = _read_ropes(hf, head_dim)
        layer_types, mlp_types = _read_schedules(hf, layers)
        rates = dict(hf.get("compress_rates") or {"compressed_sparse_attention": hf.get("compress_rate_csa", 4),
                                                  "heavily_compressed_attention": hf.get("compress_rate_hca", 128)})
        moe = deepseek_v4_moe(num_experts=hf.get("n_routed_experts", 256), top_k=hf.get("num_experts_per_tok", 6),
                              expert_dim=hf.get("moe_intermediate_size", 2048),
                              route_scale=hf.get("routed_scaling_factor", 1.5),
                              swiglu_limit=hf.get("swiglu_limit", 10.0),
                              score_func=hf.get("scoring_func", "sqrtsoftplus"))
        return DeepSeekV4Config(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=layers,
            num_heads=hf["num_attention_heads"], head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=hf.get("q_lora_rank", 1024), o_groups=hf.get("o_groups", 8),
            o_lora_rank=hf.get("o_lora_rank", 1024), sliding_window=hf.get("sliding_window", 128),
            layer_types=None if layer_types is None else tuple(layer_types), compress_rates=rates,
            index_n_heads=hf.get("index_n_heads", 64), index_head_dim=hf.get("index_head_dim", 128),
            index_topk=hf.get("index_topk", 512), mlp_layer_types=tuple(mlp_types), moe=moe,
            hc_mult=hf.get("hc_mult", 4), hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=hf.get("hc_eps", 1e-6), norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=main_theta,
            compress_rope_theta=compress_theta, compress_rope_scaling=scaling,
            max_seq_len=hf.get("max_position_embeddings", 1048576),
            mtp=_read_mtp(hf, tensor_names),
            tie_embeddings=hf.get("tie_word_embeddings", False))

    def config_to_hf(self, config: DeepSeekV4Config) -> dict[str, Any]:
        moe = config.moe
        act = moe.activation
        if act is None or act.alpha != 1.0 or act.up_shift != 0.0 or moe.num_shared_experts != 1 or moe.n_group > 1 \
                or not moe.norm_topk_prob or moe.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ValueError(f"DeepseekV4ForCausalLM routes into clamped-SwiGLU experts with one shared expert and "
                             f"renormalised weights (deepseek_v4_moe); this MoE config cannot be written: {moe}")
        rotary = config.rope_dim / config.head_dim
        compress = write_rope(config.compress_rope_theta, config.compress_rope_scaling)["rope_parameters"]
        return {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": 1, "head_dim": config.head_dim,
            "q_lora_rank": config.q_lora_rank, "o_groups": config.o_groups, "o_lora_rank": config.o_lora_rank,
            "sliding_window": config.sliding_window, "layer_types": list(config.resolved_layer_types),
            "compress_rates": dict(config.compress_rates), "index_n_heads": config.index_n_heads,
            "index_head_dim": config.index_head_dim, "index_topk": config.index_topk,
            "mlp_layer_types": list(config.resolved_mlp_layer_types), "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_dim, "n_shared_experts": 1,
            "scoring_func": moe.score_func, "routed_scaling_factor": moe.route_scale, "swiglu_limit": act.limit,
            "hc_mult": config.hc_mult, "hc_sinkhorn_iters": config.hc_sinkhorn_iters, "hc_eps": config.hc_eps,
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
            "compress_rope_theta": config.compress_rope_theta, "partial_rotary_factor": rotary,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": config.rope_theta,
                                         "partial_rotary_factor": rotary},
                                "compress": {**compress, "partial_rotary_factor": rotary}},
            "max_position_embeddings": config.max_seq_len, "num_nextn_predict_layers": 1 if config.mtp else 0,
            "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "dtype": dtype_name(config.dtype),
        }

    def hf_names(self, config: DeepSeekV4Config, name: str) -> list[str]:
        if name in _TOP_LEVEL:
            return [_TOP_LEVEL[name]]
        if name in _MTP_OWN:
            return ["model.mtp.0." + _MTP_OWN[name]]
        if name.startswith("mtp.layer."):
            return _layer_names(config, "model.mtp.0.", name.removeprefix("mtp.layer."), "moe", name)
        match = _LAYER.fullmatch(name)
        if match is None:
            raise NoHFName(name)
        layer = int(match[1])
        return _layer_names(config, f"model.layers.{layer}.", match[2], config.resolved_mlp_layer_types[layer], name)

    @staticmethod
    def _release(present: set[str]) -> bool:
        return "embed.weight" in present

    def text_prefix(self, tensor_names: set[str]) -> str:
        return "" if self._release(tensor_names) else "model."

    def disk_layout(self, config: DeepSeekV4Config, name: str, shape: tuple[int, ...], present: set[str]
                    ) -> dict[str, tuple[int, ...]] | None:
        if self._release(present) and name in _RELEASE_TOP_LEVEL:
            return {_RELEASE_TOP_LEVEL[name]: shape}
        return None

    def load(self, config: DeepSeekV4Config, name: str, files: Any, present: set[str]) -> torch.Tensor:
        return files.get(_RELEASE_TOP_LEVEL[name])

    def reported(self, config: DeepSeekV4Config, hf_name: str) -> bool:
        return not config.mtp and _MTP_NAME.fullmatch(hf_name) is not None  # a model built without the module


def _layer_names(config: DeepSeekV4Config, prefix: str, rest: str, mlp_kind: str, name: str) -> list[str]:
    """The HF names of block tensor `rest` (relative to the block) under `prefix`; `name` for the error."""
    if rest == "moe.expert_bias":  # the top-k router's selection bias; hash layers have none
        return [] if mlp_kind == "hash_moe" else [prefix + "ffn.gate.bias"]
    if rest in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
        w = rest.rpartition(".")[2]
        return [f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(config.moe.num_experts)]
    if rest in _LAYER_MAP:
        return [prefix + _LAYER_MAP[rest]]
    if rest.startswith("attention."):
        return [prefix + "attn." + rest.removeprefix("attention.")]
    raise NoHFName(name)


_TINY = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 128, "hidden_size": 32,
         "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16,
         "q_lora_rank": 16,
         "partial_rotary_factor": 0.5, "num_experts_per_tok": 2, "n_routed_experts": 4, "hc_mult": 2,
         "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
         "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, "sliding_window": 8,
         "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 64,
         "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "max_position_embeddings": 256,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
# index_topk 64 >= the compressed entries of any test sequence up to 256 tokens: no indexer ties decide.
# Not compared at shifted positions: the reference counts windows from the forward's first token.
TINY_HF_CONFIGS = {"every-attention-kind": TinyHFCase(config=_TINY, shifted_positions=False)}
