"""What each family's Hugging Face converter provides (see models/llama3/hf.py for the simplest)."""
from __future__ import annotations

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
