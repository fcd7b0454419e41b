"""The family registry: one `Family` record per model family, registered once, found by everything else.

A family is one folder, `titan_models/models/<name>/` (config and model in model.py, flavors.py, the
Hugging Face converter in hf.py), whose `__init__.py` calls `register(Family(...))`, plus its import in
`titan_models/models/__init__.py`. `from_hf`/`to_hf`, the flavor lookup, titan-rl's vLLM plugin and
the registry-driven tests all read these records; none keeps a table of its own.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from titan_models.model_config import check_model_config

if TYPE_CHECKING:
    from titan_models.accounting import ParamCount
    from titan_models.hf.converter import Converter


@dataclass(frozen=True, kw_only=True)
class PublishedSize:
    """A checkpoint's parameter count as its publisher states it, rounded as printed ("8.03B")."""

    total: str
    active: str | None = None  # MoE models: parameters one token uses


@dataclass(frozen=True, kw_only=True)
class TinyHFCase:
    """A tiny random Hugging Face checkpoint the registry-driven parity tests build with transformers
    (`transformers.AutoConfig.for_model(**config)`, then `auto_class.from_config`), compare with in float32
    both ways, and load with `from_hf`. A family gives plain config dicts unless it needs the other fields."""

    config: Mapping[str, Any]  # config.json fields, with model_type and architectures
    auto_class: str = "AutoModelForCausalLM"  # composite checkpoints: e.g. "AutoModelForImageTextToText"
    shifted_positions: bool = True  # also compare at positions that do not start at 0
    # adjusts the randomly initialised reference before it is saved (e.g. fills an index table)
    prepare: Callable[[Any], None] | None = None
    # the causal-LM architecture to_hf writes for this case's config when it is not the case's own (a
    # composite checkpoint's text model: from_hf reads the composite, to_hf writes the text form)
    written_as: str | None = None


def main_and_active(counts: ParamCount) -> tuple[int, int]:
    """The usual way publishers count: the main model (MTP excluded), and the parameters one token uses
    including the embedding table."""
    return counts.main, counts.active


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str  # e.g. "llama3"; also `config_type.family`
    config_type: type  # the family's keyword-only config dataclass; `build()` makes the model
    flavors: Mapping[str, Any]  # flavor name -> config; "debug" is a tiny model for tests and CPU demos
    published_sizes: Mapping[str, PublishedSize] = field(default_factory=dict)  # flavor -> published count
    # (total, active) of a ParamCount as the publisher counts them, compared with `published_sizes`
    count_as_published: Callable[[ParamCount], tuple[int, int]] = main_and_active
    hf: Converter | None = None  # the Hugging Face converter (config and tensor names both ways)
    # generation through the model's own definition (titan-rl's KV cache): every layer mixes tokens with an
    # attention whose `inner` the cache replaces, under the causal mask alone (no sliding window), with any
    # recurrent state (linear attention) carried in AttentionContext.recurrent_states; tests/test_families.py
    # checks incremental decoding for the families that say so
    kv_cache_generation: bool = True
    # vLLM architecture titan-rl registers -> the Hugging Face architecture whose config and weights it reads
    vllm_architectures: Mapping[str, str] = field(default_factory=dict)
    # test hook: case id -> a tiny checkpoint for the parity tests, as a TinyHFCase or just its config dict
    # (config.json fields with model_type and architectures); stored as TinyHFCase
    tiny_hf_configs: Mapping[str, TinyHFCase | Mapping[str, Any]] = field(default_factory=dict)

    @property
    def hf_architectures(self) -> tuple[str, ...]:
        return self.hf.architectures if self.hf is not None else ()

    def __post_init__(self) -> None:
        cases = {k: v if isinstance(v, TinyHFCase) else TinyHFCase(config=v) for k, v in self.tiny_hf_configs.items()}
        object.__setattr__(self, "tiny_hf_configs", cases)  # frozen: set once, here
        for case_id, case in cases.items():
            if not {"model_type", "architectures"} <= set(case.config):
                raise ValueError(f"family {self.name!r}: tiny_hf_configs[{case_id!r}] needs model_type and "
                                 f"architectures")
        if getattr(self.config_type, "family", None) != self.name:
            raise ValueError(f"family {self.name!r}: {self.config_type.__name__}.family must be {self.name!r} "
                             f"(a ClassVar), got {getattr(self.config_type, 'family', None)!r}")
        wrong = sorted(n for n, c in self.flavors.items() if type(c) is not self.config_type)
        if wrong:
            raise ValueError(f"family {self.name!r}: flavors {wrong} are not {self.config_type.__name__}")
        if "debug" not in self.flavors:
            raise ValueError(f"family {self.name!r} has no 'debug' flavor (a tiny model the tests and CPU demos "
                             f"build); it has {sorted(self.flavors)}")
        for config in self.flavors.values():
            check_model_config(config)
        unknown = sorted(set(self.published_sizes) - set(self.flavors))
        if unknown:
            raise ValueError(f"family {self.name!r}: published_sizes names unknown flavors {unknown}")
        if self.hf is not None and self.hf.config_type is not self.config_type:
            raise ValueError(f"family {self.name!r}: its converter reads {self.hf.config_type.__name__}, "
                             f"not {self.config_type.__name__}")
        stray = sorted(set(self.vllm_architectures.values()) - set(self.hf_architectures))
        if stray:
            raise ValueError(f"family {self.name!r}: vllm_architectures read {stray}, which its converter "
                             f"does not ({list(self.hf_architectures)})")


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family`; ValueError when its name, config type or an architecture is already taken."""
    if family.name in _REGISTRY:
        raise ValueError(f"model family {family.name!r} is already registered")
    for other in _REGISTRY.values():
        if other.config_type is family.config_type:
            raise ValueError(f"{family.config_type.__name__} is already the config of family {other.name!r}")
        taken = set(other.hf_architectures) & set(family.hf_architectures)
        taken |= set(other.vllm_architectures) & set(family.vllm_architectures)
        if taken:
            raise ValueError(f"family {family.name!r}: architectures {sorted(taken)} belong to {other.name!r}")
    _REGISTRY[family.name] = family
    return family


def families() -> list[Family]:
    """Every registered family, by name; each record holds its flavors, converter and test hooks."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def family(name: str) -> Family:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model family {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def family_of(config: Any) -> Family:
    """The family whose config type `config` is (or, for a subclass of a family's config, that family)."""
    for record in _REGISTRY.values():
        if type(config) is record.config_type:
            return record
    for record in _REGISTRY.values():
        if isinstance(config, record.config_type):
            return record
    raise ValueError(f"{type(config).__name__} is not the config of a registered model family "
                     f"({sorted(_REGISTRY)})")


def flavors(family_name: str) -> list[str]:
    return list(family(family_name).flavors)


def flavor(family_name: str, name: str) -> Any:
    """A copy of the named config (e.g. `flavor("llama3", "8B")`); edit or transform it freely."""
    table = family(family_name).flavors
    if name not in table:
        raise ValueError(f"unknown {family_name} flavor {name!r}; choose one of {sorted(table)}")
    return copy.deepcopy(table[name])


def vllm_architectures() -> Mapping[str, str]:
    """vLLM architecture name -> the Hugging Face architecture it reads, over every family."""
    return MappingProxyType({ours: hf for record in families() for ours, hf in record.vllm_architectures.items()})
