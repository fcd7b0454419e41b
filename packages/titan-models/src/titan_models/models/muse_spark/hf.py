"""Muse Spark (`MuseSparkForConditionalGeneration`, the composite image-text-audio checkpoint) <->
MuseSparkConfig; layout and composite handling as Muse Glimmer's (models/muse_glimmer/hf.py).

MoE layers store the router as `mlp.gate.weight` with its selection bias `mlp.gate.e_score_correction_bias`,
the pooling as `mlp.pre_expert_proj`, `mlp.pre_expert_norm`, `mlp.post_expert_proj`, the experts fused:
`mlp.experts.gate_up_proj` [E, 2 * expert_dim, moe_dim] (gate rows first, then up; titan's w1 and w3),
`mlp.experts.down_proj` [E, moe_dim, expert_dim] (w2) and `mlp.experts.post_expert_norm.weight`.
Residual gates: `post_attention_residual_gate.gate`, `post_feedforward_residual_gate.gate`.
"""
from __future__ import annotations

from typing import Any

import torch

from titan_models.hf.converter import require
from titan_models.models.muse_glimmer.hf import (
    MUSE_LAYER, TINY_MULTIMODAL, TINY_TEXT, MuseConverter, scale_lm_head,
)
from titan_models.models.muse_spark.model import MLP_LAYER_TYPES, MuseSparkConfig, muse_spark_moe
from titan_models.registry import TinyHFCase

_SPARK_LAYER = {k: v for k, v in MUSE_LAYER.items() if k != "post_attention_norm.weight"} | {
    "attention_residual.gate": "post_attention_residual_gate.gate",
    "ffn_residual.gate": "post_feedforward_residual_gate.gate",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.pre_expert_proj.weight": "mlp.pre_expert_proj.weight",
    "moe.pre_expert_norm.weight": "mlp.pre_expert_norm.weight",
    "moe.post_expert_norm.weight": "mlp.experts.post_expert_norm.weight",
    "moe.post_expert_proj.weight": "mlp.post_expert_proj.weight",
    "moe.experts.w1": "mlp.experts.gate_up_proj",
    "moe.experts.w3": "mlp.experts.gate_up_proj",
    "moe.experts.w2": "mlp.experts.down_proj",
}
_GATE_UP = ("moe.experts.w1", "moe.experts.w3")


class MuseSparkConverter(MuseConverter):
    architectures = ("MuseSparkForConditionalGeneration",)
    config_type = MuseSparkConfig
    model_type = "muse_spark"
    default_rope_theta = 500_000.0

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> MuseSparkConfig:
        text, fields = self.text_fields(hf)
        require(text, "hidden_act", ("silu",), "silu")
        require(text, "num_shared_experts", (0, None), 0)
        kinds = text.get("mlp_layer_types")
        if kinds is not None:
            bad = sorted({k for k in kinds if k not in MLP_LAYER_TYPES})
            if bad or len(kinds) != fields["num_layers"]:
                raise ValueError(f"config.json field mlp_layer_types={kinds} needs {fields['num_layers']} entries "
                                 f"of {list(MLP_LAYER_TYPES)}")
            kinds = tuple(kinds)
        defaults = MuseSparkConfig.__dataclass_fields__
        multiplier = fields.get("output_multiplier", defaults["output_multiplier"].default)
        moe = muse_spark_moe(num_experts=text.get("num_local_experts", 256), top_k=text.get("num_experts_per_tok", 8),
                             expert_dim=text.get("moe_intermediate_size", 4096),
                             moe_dim=text.get("moe_hidden_size", 4096), output_multiplier=multiplier,
                             rms_norm_eps=fields["rms_norm_eps"], post_norm_eps=fields["post_norm_eps"],
                             route_scale=float(text.get("routed_scaling_factor", 1.0)))
        return MuseSparkConfig(**fields, ffn_dim=text.get("intermediate_size", 16384), moe=moe, mlp_layer_types=kinds,
                               residual_gate_temperature=float(text.get("residual_gate_temperature", 0.3)))

    def config_to_hf(self, config: MuseSparkConfig) -> dict[str, Any]:
        moe = config.moe
        expected = muse_spark_moe(num_experts=moe.num_experts, top_k=moe.top_k, expert_dim=moe.expert_dim,
                                  moe_dim=moe.expert_pool_dim or 0, output_multiplier=config.output_multiplier,
                                  rms_norm_eps=config.rms_norm_eps, post_norm_eps=config.post_norm_eps,
                                  route_scale=moe.route_scale)
        if moe != expected:
            raise ValueError("MuseSparkForConditionalGeneration routes by renormalised sigmoid top-k on the logits "
                             f"times output_multiplier into pooled experts (muse_spark_moe); this MoE config cannot "
                             f"be written: {moe}")
        text = self.text_to_hf(config) | {
            "hidden_act": "silu", "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_dim, "moe_hidden_size": moe.expert_pool_dim,
            "routed_scaling_factor": moe.route_scale, "mlp_layer_types": list(config.mlp_kinds()),
            "residual_gate_temperature": config.residual_gate_temperature}
        # transformers requires the audio tower to emit the text width; its other defaults stay
        return self.composite(config, text, {"audio_config": {"out_hidden_size": config.dim}})

    def layer_map(self, config: Any) -> dict[str, str]:
        return _SPARK_LAYER

    def _gate_up_name(self, config: MuseSparkConfig, name: str, present: set[str]) -> str:
        """gate_up_proj's name: under the composite's text prefix when reading one (`present`), else `model.*`."""
        (hf_name,) = self.hf_names(config, name)
        prefix = self.text_prefix(present)
        return prefix + hf_name.removeprefix("model.")

    def disk_layout(self, config: MuseSparkConfig, name: str, shape: tuple[int, ...], present: set[str]
                    ) -> dict[str, tuple[int, ...]] | None:
        if not name.endswith(_GATE_UP):
            return None
        moe = config.moe
        return {self._gate_up_name(config, name, present): (moe.num_experts, 2 * moe.expert_dim, moe.expert_pool_dim)}

    def load(self, config: MuseSparkConfig, name: str, files: Any, present: set[str]) -> torch.Tensor:
        gate, up = files.get(self._gate_up_name(config, name, present)).chunk(2, dim=1)
        return gate if name.endswith("w1") else up

    def to_hf_tensor(self, config: MuseSparkConfig, hf_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        by_kind = {n.rpartition(".")[2]: t for n, t in parts.items()}
        return torch.cat([by_kind["w1"], by_kind["w3"]], dim=1)


TINY_AUDIO = {"patch_sizes": [2, 2], "hidden_sizes": [16, 32], "depths": [1, 1], "num_hidden_layers": 2,
              "out_hidden_size": TINY_TEXT["hidden_size"]}
_TINY_SPARK = TINY_TEXT | {"num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                           "moe_hidden_size": 48, "routed_scaling_factor": 1.5,
                           "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}


def _case(text: dict[str, Any]) -> TinyHFCase:
    return TinyHFCase(config={"model_type": "muse_spark", "architectures": ["MuseSparkForConditionalGeneration"],
                              "text_config": text, "audio_config": TINY_AUDIO, **TINY_MULTIMODAL},
                      auto_class="AutoModelForImageTextToText", prepare=scale_lm_head(30.0))


TINY_HF_CONFIGS = {
    "composite": _case(_TINY_SPARK),
    "all-sparse-custom-nope": _case(_TINY_SPARK | {"mlp_layer_types": ["sparse"] * 4,
                                                   "layer_rope_theta": [0, 500000.0, 0, 0]}),
}
