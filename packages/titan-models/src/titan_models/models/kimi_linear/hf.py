"""KimiLinearForCausalLM <-> KimiLinearConfig.

Layout (the release's, which transformers 5.20 writes back): Kimi Delta Attention layers store
`self_attn.{q,k,v}_proj`, the convs apart as `self_attn.{q,k,v}_conv1d.weight` [C, 1, K], the forget gate
directly under `self_attn.` (`f_a_proj`, `f_b_proj`, `dt_bias` [H*dk], `A_log` [1, 1, H, 1]), `b_proj`, the
output gate `g_a_proj`/`g_b_proj`, `o_norm` and `o_proj`; MLA layers DeepSeek-V3's names. Dense and MoE
feed-forwards both live under `block_sparse_moe.` (`gate_proj`/`up_proj`/`down_proj`; `gate`,
`gate.e_score_correction_bias`, `shared_experts.*`, `experts.{e}.w1/w2/w3`).

config.json spells the MoE settings by transformers' attribute-map names (`num_experts`,
`num_experts_per_token`, `num_expert_group`, `num_shared_experts`, `moe_renormalize`, `model_max_length`;
the DeepSeek spellings are read too), and release configs give the schedule as `linear_attn_config`
with 1-indexed `kda_layers` / `full_attn_layers` (an explicit `layer_types` wins, as in transformers).
`head_dim` is ignored (transformers overwrites it with `qk_rope_head_dim`), and so is
`tie_word_embeddings`: transformers' KimiLinearForCausalLM declares no tied weights and always loads
`lm_head.weight` (without it the head would be random there; from_hf reports it missing).
"""
from __future__ import annotations

from typing import Any

from titan_models.components.layer_types import FULL_ATTENTION, LINEAR_ATTENTION
from titan_models.components.moe import MoEConfig
from titan_models.components.norms import RMSNormConfig
from titan_models.hf.converter import Converter, HFSource, Reshaped, dtype_name, require, rms_eps
from titan_models.hf.names import MLA, NoHFName, hf_names
from titan_models.models.kimi_linear.model import DENSE, LAYER_TYPES, MLP_LAYER_TYPES, SPARSE, KimiLinearConfig

_COMMON = {
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "block_sparse_moe.gate_proj.weight",
    "feed_forward.w2.weight": "block_sparse_moe.down_proj.weight",
    "feed_forward.w3.weight": "block_sparse_moe.up_proj.weight",
    "moe.router.gate.weight": "block_sparse_moe.gate.weight",
    "moe.expert_bias": "block_sparse_moe.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "block_sparse_moe.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "block_sparse_moe.shared_experts.up_proj.weight",
}
_EXPERTS = {"moe.experts.w1": "w1", "moe.experts.w2": "w2", "moe.experts.w3": "w3"}
_KDA = {f"attention.{titan}": f"self_attn.{hf}" for titan, hf in {
    "wq.weight": "q_proj.weight", "wk.weight": "k_proj.weight", "wv.weight": "v_proj.weight",
    "q_conv.weight": "q_conv1d.weight", "k_conv.weight": "k_conv1d.weight", "v_conv.weight": "v_conv1d.weight",
    "wa.down.weight": "f_a_proj.weight", "wa.up.weight": "f_b_proj.weight", "decay.dt_bias": "dt_bias",
    "wb.weight": "b_proj.weight", "wz.down.weight": "g_a_proj.weight", "wz.up.weight": "g_b_proj.weight",
    "norm.weight": "o_norm.weight", "wo.weight": "o_proj.weight"}.items()}
# config.json name (what transformers writes) -> the DeepSeek-V3 spelling its attribute map also accepts
_ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
            "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
            "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}


def _get(hf: dict[str, Any], name: str, default: Any) -> Any:
    return hf.get(name, hf.get(_ALIASES[name], default))


def _schedule_from_lists(linear: dict[str, Any], layers: int) -> tuple[str, ...] | None:
    """layer_types from linear_attn_config's 1-indexed kda_layers / full_attn_layers (None without them)."""
    if "kda_layers" not in linear or "full_attn_layers" not in linear:
        return None
    kinds: list[str | None] = [None] * layers
    for field, kind in (("full_attn_layers", FULL_ATTENTION), ("kda_layers", LINEAR_ATTENTION)):
        for layer in linear[field]:
            if not isinstance(layer, int) or not 1 <= layer <= layers:
                raise ValueError(f"config.json field linear_attn_config.{field} has {layer!r}; entries are "
                                 f"1-indexed layers in [1, {layers}]")
            kinds[layer - 1] = kind
    missing = [i + 1 for i, kind in enumerate(kinds) if kind is None]
    if missing:
        raise ValueError(f"config.json field linear_attn_config: layers {missing} (1-indexed) are in neither "
                         "kda_layers nor full_attn_layers")
    return tuple(kinds)


def _listed(hf: dict[str, Any], field: str, allowed: tuple[str, ...], layers: int) -> tuple[str, ...] | None:
    value = hf.get(field)
    if value is None:
        return None
    bad = sorted({t for t in value if t not in allowed})
    if bad or len(value) != layers:
        raise ValueError(f"config.json field {field} must list one of {list(allowed)} for each of the "
                         f"{layers} layers; got {list(value)}")
    return tuple(value)


def _moe(hf: dict[str, Any]) -> MoEConfig:
    return MoEConfig(num_experts=_get(hf, "num_experts", 256), top_k=_get(hf, "num_experts_per_token", 8),
                     expert_dim=hf.get("moe_intermediate_size", 1024),
                     num_shared_experts=_get(hf, "num_shared_experts", 1) or 0, score_func="sigmoid",
                     n_group=_get(hf, "num_expert_group", 1) or 1, topk_group=hf.get("topk_group") or 1,
                     norm_topk_prob=_get(hf, "moe_renormalize", True),
                     route_scale=hf.get("routed_scaling_factor", 2.446))


class KimiLinearConverter(Converter):
    architectures = ("KimiLinearForCausalLM",)
    config_type = KimiLinearConfig

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> KimiLinearConfig:
        require(hf, "hidden_act", ("silu",), "silu")
        require(hf, "attention_bias", (False,), False)
        require(hf, "mla_use_nope", (True,), True)
        require(hf, "moe_router_activation_func", ("sigmoid",), "sigmoid")
        require(hf, "moe_layer_freq", (1,), 1)
        require(hf, "num_nextn_predict_layers", (0, None), 0)
        layers = hf.get("num_hidden_layers", 27)
        linear = hf.get("linear_attn_config") or {}
        layer_types = _listed(hf, "layer_types", LAYER_TYPES, layers) or _schedule_from_lists(linear, layers)
        first_k_dense = hf.get("first_k_dense_replace", 1)
        mlp_types = _listed(hf, "mlp_layer_types", MLP_LAYER_TYPES, layers) or tuple(
            DENSE if i < first_k_dense else SPARSE for i in range(layers))
        return KimiLinearConfig(
            vocab_size=hf.get("vocab_size", 163840), dim=hf.get("hidden_size", 2304), num_layers=layers,
            num_heads=hf.get("num_attention_heads", 32), ffn_dim=hf.get("intermediate_size", 9216),
            moe=_moe(hf) if SPARSE in mlp_types else None, mlp_layer_types=mlp_types,
            first_k_dense=min(first_k_dense, layers), q_lora_rank=hf.get("q_lora_rank") or None,
            kv_lora_rank=hf.get("kv_lora_rank", 512), qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=hf.get("qk_rope_head_dim", 64), v_head_dim=hf.get("v_head_dim") or 128,
            linear_num_heads=linear.get("num_heads", hf.get("linear_num_heads", 32)),
            linear_head_dim=linear.get("head_dim", hf.get("linear_head_dim", 128)),
            linear_conv_kernel=linear.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)),
            layer_types=layer_types, norm=RMSNormConfig(eps=hf.get("rms_norm_eps", 1e-5)),
            max_seq_len=_get(hf, "model_max_length", 1_048_576), tie_embeddings=False)

    def config_to_hf(self, config: KimiLinearConfig) -> dict[str, Any]:
        moe = config.moe
        if moe is not None and (moe.score_func != "sigmoid" or moe.shared_expert_dim is not None
                                or moe.shared_expert_gate):
            raise ValueError("KimiLinearForCausalLM routes with sigmoid scores and ungated shared experts of "
                             f"num_shared_experts * expert_dim; this MoE config cannot be written: {moe}")
        if config.tie_embeddings:
            raise ValueError("KimiLinearForCausalLM never ties its head to the embedding; set tie_embeddings=False")
        kinds = config.layer_kinds()
        moe = moe or MoEConfig(num_experts=1, top_k=1, expert_dim=1, score_func="sigmoid")  # unused: all dense
        return {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.ffn_dim,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_heads, "q_lora_rank": config.q_lora_rank,
            "kv_lora_rank": config.kv_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
            "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim, "mla_use_nope": True,
            "linear_attn_config": {
                "num_heads": config.linear_num_heads, "head_dim": config.linear_head_dim,
                "short_conv_kernel_size": config.linear_conv_kernel,
                "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == LINEAR_ATTENTION],
                "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == FULL_ATTENTION]},
            "mlp_layer_types": list(config.mlp_kinds()), "first_k_dense_replace": config.first_k_dense,
            "num_experts": moe.num_experts, "num_experts_per_token": moe.top_k, "moe_intermediate_size": moe.expert_dim,
            "num_shared_experts": moe.num_shared_experts, "num_expert_group": moe.n_group,
            "topk_group": moe.topk_group, "moe_renormalize": moe.norm_topk_prob,
            "routed_scaling_factor": moe.route_scale, "moe_router_activation_func": "sigmoid",
            "hidden_act": "silu", "rms_norm_eps": rms_eps(config), "model_max_length": config.max_seq_len,
            "tie_word_embeddings": False, "attention_bias": False,
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "dtype": dtype_name(config.dtype),
        }

    def hf_names(self, config: KimiLinearConfig, name: str) -> list[HFSource]:
        layer, _, rest = name.removeprefix("layers.").partition(".")
        if not name.startswith("layers.") or not layer.isdigit():
            return hf_names(name, {})  # embedding, final norm, head
        prefix = f"model.layers.{layer}."
        if config.layer_kinds()[int(layer)] == LINEAR_ATTENTION and rest.startswith("attention."):
            if rest == "attention.decay.A_log":
                return [Reshaped(prefix + "self_attn.A_log", (1, 1, config.linear_num_heads, 1))]
            layer_map = _KDA
        else:
            layer_map = MLA
        if rest in _EXPERTS:
            experts = config.moe.num_experts
            return [f"{prefix}block_sparse_moe.experts.{e}.{_EXPERTS[rest]}.weight" for e in range(experts)]
        hf = (layer_map | _COMMON).get(rest)
        if hf is None:
            raise NoHFName(name)
        return [prefix + hf]


_TINY = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 128,
         "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_token": 2,
         "num_shared_experts": 1,
         "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
         "routed_scaling_factor": 2.5, "model_max_length": 256, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None}
# Tiny random checkpoints for the registry-driven parity tests (case id -> config.json fields): both
# schedule spellings, dense and MoE feed-forwards, grouped routing, q_lora_rank, and tie_word_embeddings
# ignored as transformers ignores it.
TINY_HF_CONFIGS = {
    "release-schedule": _TINY | {"first_k_dense_replace": 1, "linear_attn_config": {
        "kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4, "head_dim": 8,
        "short_conv_kernel_size": 4}},
    "layer-types-groups-q-lora": _TINY | {
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"], "num_expert_group": 4, "topk_group": 2,
        "q_lora_rank": 24, "linear_num_heads": 2, "linear_head_dim": 16, "linear_conv_kernel_dim": 3,
        "tie_word_embeddings": True},
}
