"""The contract of a family config: what code outside the family (transforms, trainers, generators,
the vLLM adapter, tests) may read. A config provides each member as a dataclass field or a property,
except vocab_size, num_layers, attention and dtype, which transforms and trainers replace
(dataclasses.replace) and so must be fields.

Family configs subclass `ModelConfigBase` (a Protocol, so a config defined elsewhere may also satisfy it
structurally) to inherit the default `is_moe_layer` and `with_num_layers`. `register` runs
`check_model_config` on every flavor, so a family lacking a member fails there, naming it.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from titan_models.components.attention import ATTENTION_BACKENDS, AttentionBackend
from titan_models.components.mla import MLAConfig
from titan_models.components.moe import MoEConfig

if TYPE_CHECKING:
    from torch import nn

    from titan_models.parallel_plan import ParallelPlan


@runtime_checkable
class ModelConfigBase(Protocol):
    family: ClassVar[str]  # the registered family name

    vocab_size: int
    dim: int  # the residual stream's width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention; MLA: num_heads)
    qk_head_dim: int  # per-head width of queries and keys (MLA: the no-RoPE and RoPE parts together)
    v_head_dim: int  # per-head width of values
    ffn_dim: int  # hidden width of the dense feed-forward layers
    moe: MoEConfig | None  # the MoE layers' config; None for a dense model
    max_seq_len: int  # the context the RoPE settings target
    tie_embeddings: bool  # the output projection shares the embedding table
    attention: AttentionBackend  # one of components.attention.ATTENTION_BACKENDS
    dtype: torch.dtype  # of the parameters build() makes

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i is a MoE layer (the others are dense); by default all when `moe` is set."""
        return self.moe is not None

    def with_num_layers(self, n: int) -> ModelConfigBase:
        """A copy with n layers whose layer layout stays valid (a family with a dense prefix keeps it
        inside the model)."""
        return dataclasses.replace(self, num_layers=n)

    def parallel_plan(self) -> ParallelPlan:
        """What a trainer may split (titan_models.parallel_plan); build() attaches it to the model."""
        ...

    def build(self) -> nn.Module:
        ...


class SharedHeadDim:
    """The contract's head widths for a config whose queries, keys and values all have the width of its
    `head_dim` field (Qwen3, gpt-oss, Muse, DeepSeek-V4); `resolved_head_dim` as Llama3Config names it."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim


class LatentAttentionHeads:
    """The contract's head counts and widths, and the MLA layers' config, for a config with the fields of
    multi-head latent attention (num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim, attention): DeepSeek-V3 / Kimi K2.x and Kimi Linear."""

    @property
    def num_kv_heads(self) -> int:  # MLA expands its latent into keys and values for every head
        return self.num_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def latent_attention(self, **settings: Any) -> MLAConfig:
        """The MLAConfig of these fields; `settings`: the family's own MLAConfig fields (RoPE layout, YaRN's
        softmax scale, no RoPE at all)."""
        return MLAConfig(num_heads=self.num_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                         qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                         v_head_dim=self.v_head_dim, backend=self.attention, **settings)


# member -> the types its value may have (checked on every registered flavor)
_FIELDS: dict[str, tuple[type, ...]] = {
    "vocab_size": (int,), "dim": (int,), "num_layers": (int,), "num_heads": (int,), "num_kv_heads": (int,),
    "qk_head_dim": (int,), "v_head_dim": (int,), "ffn_dim": (int,), "moe": (MoEConfig, type(None)),
    "max_seq_len": (int,), "tie_embeddings": (bool,), "attention": (str,), "dtype": (torch.dtype,),
}
_METHODS = ("is_moe_layer", "with_num_layers", "parallel_plan", "build")
# members transforms and trainers change with dataclasses.replace (vocabulary to the tokenizer's size,
# fp32 master weights, the attention backend, fewer layers), so fields rather than properties
_REPLACEABLE = ("vocab_size", "num_layers", "attention", "dtype")
assert set(_FIELDS) | {"family"} == set(typing.get_type_hints(ModelConfigBase, localns={"ParallelPlan": Any})), \
    "_FIELDS must list every data member of ModelConfigBase"


def check_model_config(config: Any) -> None:
    """ValueError naming the contract members `config` lacks; TypeError for a member of the wrong type."""
    name = type(config).__name__
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"a model config is a dataclass instance; got {config!r}")
    missing = [m for m in ("family", *_FIELDS, *_METHODS) if not hasattr(config, m)]
    if missing:
        raise ValueError(f"{name} lacks {', '.join(missing)}, which the model-config contract "
                         f"(titan_models.ModelConfigBase) requires")
    for member, types in _FIELDS.items():
        value = getattr(config, member)
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            allowed = " or ".join(t.__name__ for t in types)
            raise TypeError(f"{name}.{member} must be {allowed}, got {value!r}")
    fields = {f.name for f in dataclasses.fields(config)}
    not_fields = [m for m in _REPLACEABLE if m not in fields]
    if not_fields:
        raise ValueError(f"{name}: {', '.join(not_fields)} must be dataclass fields (transforms and trainers "
                         f"replace them), not properties")
    if config.attention not in ATTENTION_BACKENDS:
        raise ValueError(f"{name}.attention={config.attention!r} is not one of {ATTENTION_BACKENDS}")
    for method in _METHODS:
        if not callable(getattr(config, method)):
            raise TypeError(f"{name}.{method} must be a method")
