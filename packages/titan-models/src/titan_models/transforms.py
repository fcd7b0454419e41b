"""Config transforms: functions config -> config that compose.

    config = compose(num_layers(2), attention("flex"), dtype(torch.bfloat16))(config)

Each returns a new config (dataclasses.replace) and raises ValueError when the config has no such
field (e.g. `moe(...)` on a dense model).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from titan_models.components.attention import ATTENTION_BACKENDS
from titan_models.components.moe import EXPERT_IMPLEMENTATIONS
from titan_models.components.norms import LayerNormConfig, NormConfig, RMSNormConfig
from titan_models.model_config import ModelConfigBase

Transform = Callable[[Any], Any]


def compose(*transforms: Transform) -> Transform:
    """Apply `transforms` left to right."""

    def composed(config: Any) -> Any:
        for transform in transforms:
            config = transform(config)
        return config

    return composed


def _replace(config: Any, **changes: Any) -> Any:
    fields = {f.name for f in dataclasses.fields(config)}
    for name in changes:
        if name not in fields:
            raise ValueError(f"{type(config).__name__} has no field {name!r}; it has {sorted(fields)}")
    return dataclasses.replace(config, **changes)


def num_layers(n: int) -> Transform:
    if n < 1:
        raise ValueError(f"num_layers must be >= 1, got {n}")

    def transform(config: ModelConfigBase) -> ModelConfigBase:
        return config.with_num_layers(n)  # the family keeps its layer layout valid (e.g. a dense prefix)

    return transform


def attention(backend: str) -> Transform:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    return lambda config: _replace(config, attention=backend)


def dtype(value: torch.dtype) -> Transform:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {value!r}")
    return lambda config: _replace(config, dtype=value)


def norm(kind: str | NormConfig, *, eps: float | None = None) -> Transform:
    """Switch every norm to "rmsnorm" / "layernorm" (or a given norm config), keeping eps unless given."""
    if isinstance(kind, (RMSNormConfig, LayerNormConfig)):
        new_norm: NormConfig | None = kind
    elif kind in ("rmsnorm", "layernorm"):
        new_norm = None
    else:
        raise ValueError(f"unknown norm {kind!r}; choose 'rmsnorm', 'layernorm' or a norm config")

    def transform(config: Any) -> Any:
        if new_norm is not None:
            return _replace(config, norm=new_norm)
        cls = RMSNormConfig if kind == "rmsnorm" else LayerNormConfig
        return _replace(config, norm=cls(eps=config.norm.eps if eps is None else eps))

    return transform


def moe(*, implementation: str | None = None, **fields: Any) -> Transform:
    """Change the MoE config: the expert computation ("auto", "loop", "grouped_mm") and/or any
    MoEConfig field (e.g. top_k, route_scale)."""
    if implementation is not None:
        if implementation not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"unknown expert implementation {implementation!r}; choose one of {EXPERT_IMPLEMENTATIONS}")
        fields["implementation"] = implementation

    def transform(config: ModelConfigBase) -> ModelConfigBase:
        if config.moe is None:
            raise ValueError(f"{type(config).__name__} has no MoE layers to configure")
        return _replace(config, moe=_replace(config.moe, **fields))

    return transform
