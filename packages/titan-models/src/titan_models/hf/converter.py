"""What each family's Hugging Face converter provides (see models/llama3/hf.py for the simplest)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from titan_models.components.norms import RMSNormConfig


@dataclass(frozen=True)
class Rows:
    """Some rows of a Hugging Face tensor: the titan tensor is `hf_name[list(rows)]` (dim 0), for layouts
    that fuse several titan tensors into one (the parts of a fused tensor partition its rows)."""

    hf_name: str
    rows: tuple[int, ...]

    @staticmethod
    def span(hf_name: str, start: int, stop: int) -> "Rows":
        return Rows(hf_name, tuple(range(start, stop)))


@dataclass(frozen=True)
class Reshaped:
    """A Hugging Face tensor holding the titan tensor's elements in another shape (e.g. Kimi Linear's
    `A_log` [1, 1, H, 1] for titan's [H]): loaded and written with a reshape."""

    hf_name: str
    shape: tuple[int, ...]  # the shape on disk


HFSource = Union[str, Rows, Reshaped]  # what `hf_names` lists: a whole tensor, rows of one, or a reshaped one


def source_name(source: HFSource) -> str:
    return source if isinstance(source, str) else source.hf_name


class Converter:
    architectures: tuple[str, ...] = ()  # HF `architectures` entries this converter reads
    config_type: type = object

    def config_from_hf(self, hf: dict[str, Any], tensor_names: set[str]) -> Any:
        raise NotImplementedError

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        raise NotImplementedError

    def hf_names(self, config: Any, name: str) -> list[HFSource]:
        """HF tensors holding titan tensor `name` (several = stacked experts; none = not stored, zero;
        a `Rows` = part of a fused HF tensor)."""
        raise NotImplementedError

    def disk_layout(self, config: Any, name: str, shape: tuple[int, ...], present: set[str]
                    ) -> dict[str, tuple[int, ...]] | None:
        """For a tensor stored in a layout `hf_names` cannot describe (interleaved, transposed or quantized:
        gpt-oss's experts), the HF tensors holding it with their on-disk shapes; `present` names the
        folder's tensors when reading (a converter may accept several layouts), empty when writing.
        None (the default): the `hf_names` layout. Such tensors are read by `load` and written by
        `to_hf_tensor`."""
        return None

    def load(self, config: Any, name: str, files: Any, present: set[str]) -> torch.Tensor:
        """Titan tensor `name` (one with a `disk_layout`) from `files`, a SafetensorsFolder."""
        raise NotImplementedError(f"{type(self).__name__} declares a disk layout for {name} but no load")

    def to_hf_tensor(self, config: Any, hf_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """HF tensor `hf_name` from the titan tensors with a `disk_layout` that `hf_names` maps to it."""
        raise NotImplementedError(f"{type(self).__name__} declares a disk layout for {hf_name} but no writer")

    def text_prefix(self, tensor_names: set[str]) -> str:
        """Where the decoder's `model.*` tensors live in this checkpoint: "model." for a causal-LM
        folder; composite (multimodal) checkpoints override this (e.g. "model.language_model.")."""
        return "model."

    def checkpoint_prefixes(self, tensor_names: set[str]) -> dict[str, str]:
        """Name prefixes of the causal-LM layout (`hf_names`' "model.", "lm_head.") -> where this
        checkpoint keeps them; by default only the decoder moves, to `text_prefix`."""
        return {"model.": self.text_prefix(tensor_names)}

    def reported(self, config: Any, hf_name: str) -> bool:
        """HF tensors present but not part of the titan model (another tower, an MTP head): loaded
        into nothing and listed in a warning by from_hf, rather than refused as unexpected."""
        return False

    def ignorable(self, config: Any, hf_name: str) -> bool:
        """HF tensors that may be present without being loaded (derived or duplicated data)."""
        return bool(re.fullmatch(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", hf_name)) or (
            config.tie_embeddings and hf_name == "lm_head.weight")

    def extra_tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Tensors written besides the mapped state (e.g. duplicates a format expects)."""
        return []


# config.json fields the converters read, by the JSON type each must have: a wrong type would fail deep
# inside a model's construction (or build a wrong model) instead of naming the field.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim", "max_position_embeddings", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok", "num_experts", "num_local_experts", "kv_lora_rank",
                "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "decoder_sparse_step",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "shared_expert_intermediate_size", "full_attention_interval",
                "num_experts_per_token", "model_max_length", "linear_num_heads", "linear_head_dim")  # Kimi Linear's
_COUNT_FIELDS = ("n_shared_experts", "n_group", "topk_group", "first_k_dense_replace", "num_nextn_predict_layers",
                 "num_mtp_layers", "num_shared_experts", "num_expert_group")
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
_BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "attention_bias", "mlp_bias", "rope_interleave",
                "use_sliding_window", "moe_renormalize", "mla_use_nope")
_OBJECT_FIELDS = ("rope_scaling", "rope_parameters", "linear_attn_config")
# Read as `hf.get(field) or default`: null means "the default".
_NULLABLE = ("head_dim", "num_key_value_heads", "q_lora_rank", "n_shared_experts", "n_group", "topk_group",
             "num_nextn_predict_layers", "rope_scaling", "rope_parameters", "num_experts", "num_local_experts",
             "num_shared_experts", "num_expert_group", "linear_attn_config")


def check_field_types(hf: Any, where: str) -> None:
    """ValueError naming `where` (config.json's path) and the field, unless `hf` is a JSON object whose
    known fields have their JSON types (sizes positive integers, counts integers >= 0, numbers, booleans,
    objects). Fields that are absent are left to each converter (which names the one it misses)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where} holds a JSON {type(hf).__name__}, not an object")
    architectures = hf.get("architectures", [])
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise ValueError(f"{where}: field architectures is {json_repr(architectures)}; it must be an array of strings")
    for field, value in hf.items():
        if value is None and field in _NULLABLE:
            continue
        if field in _SIZE_FIELDS or field in _COUNT_FIELDS:
            least = 1 if field in _SIZE_FIELDS else 0
            if not (type(value) is int and value >= least):
                raise ValueError(f"{where}: field {field} is {json_repr(value)}; it must be an integer >= {least}")
        elif field in _NUMBER_FIELDS:
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ValueError(f"{where}: field {field} is {json_repr(value)}; it must be a finite number")
        elif field in _BOOL_FIELDS and type(value) is not bool:
            raise ValueError(f"{where}: field {field} is {json_repr(value)}; it must be true or false")
        elif field in _OBJECT_FIELDS and not isinstance(value, dict):
            raise ValueError(f"{where}: field {field} is {json_repr(value)}; it must be an object")


def json_repr(value: Any) -> str:
    return f"{json.dumps(value)} (a JSON {_JSON_TYPES.get(type(value), type(value).__name__)})"


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               type(None): "null"}


def require(hf: dict[str, Any], field: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        raise ValueError(f"config.json field {field}={value!r} is not supported; supported: {list(allowed)}")


def rms_eps(config: Any) -> float:
    if not isinstance(config.norm, RMSNormConfig):
        raise ValueError(f"Hugging Face {config.family} models use RMSNorm; this config has {config.norm}")
    return config.norm.eps


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
