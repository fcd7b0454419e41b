"""The KV cache: a generation context and the inner-attention override that owns the cache.

`install_kv_cache(model)` wraps every `layers.N.attention.inner` (through titan-models' `override`)
in a `KVCacheAttention`. Called with an ordinary context (or none), the wrapper is transparent (the
trainer's forward is unchanged); called with a `GenerationContext`, it writes this step's k/v into the
cache at the tokens' positions and attends over the cache, with the wrapped attention's
`sliding_window` (keys older than the window are masked; the cache keeps every slot) and the
attention sinks the model passes (`sinks=`, gpt-oss; the eager sink softmax over the cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import titan_models as tm
import torch
import torch.nn.functional as F
from titan_models.components.sinks import eager_attention
from torch import nn


@dataclass(kw_only=True)
class GenerationContext(tm.AttentionContext):
    """positions [b, s]: each new token's position (= its cache slot); kv_len [b]: valid slots after
    this step; caches: per attention module name, (k, v) [b, L, hkv, d]."""

    positions: torch.Tensor
    kv_len: torch.Tensor
    caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    capacity: int = 0


class KVCacheAttention(nn.Module):
    def __init__(self, base: nn.Module, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name

    def replace_base(self, base: nn.Module) -> "KVCacheAttention":
        self.base = base
        return self

    @property
    def scale(self) -> float:
        return self.base.scale

    @property
    def sliding_window(self) -> int | None:
        return getattr(self.base, "sliding_window", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context=None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if sinks is None else {"sinks": sinks}  # inner attentions without sinks take no such kwarg
        if not isinstance(context, GenerationContext):
            return self.base(q, k, v, context=context, **extra)
        b, s, hkv, d = k.shape
        if self.name not in context.caches:
            shape = (b, context.capacity, hkv)
            context.caches[self.name] = (k.new_zeros(*shape, d), v.new_zeros(*shape, v.shape[-1]))
        cache_k, cache_v = context.caches[self.name]
        slots = context.positions[:, :, None, None]
        cache_k.scatter_(1, slots.expand(b, s, hkv, d), k)
        cache_v.scatter_(1, slots.expand(b, s, hkv, v.shape[-1]), v)
        attend = getattr(self.base, "attend", None)
        if attend is not None:
            return attend(q, cache_k, cache_v, q_positions=context.positions, kv_len=context.kv_len, **extra)
        mask = _cache_mask(cache_k.shape[1], context.positions, context.kv_len, self.sliding_window)
        if sinks is not None:  # SDPA has no term for sinks
            return eager_attention(q, cache_k, cache_v, scale=self.base.scale, mask=mask[:, None], sinks=sinks)
        return _sdpa_over_cache(q, cache_k, cache_v, mask, self.base.scale)


def _cache_mask(slots: int, positions: torch.Tensor, kv_len: torch.Tensor, window: int | None) -> torch.Tensor:
    """[b, s, L] bool: slot <= position, slot < kv_len, and within the window (position - slot < window)."""
    slot = torch.arange(slots, device=positions.device)[None, None, :]
    pos = positions[:, :, None]
    mask = (slot <= pos) & (slot < kv_len[:, None, None])
    return mask if window is None else mask & (pos - slot < window)


def _sdpa_over_cache(q, cache_k, cache_v, mask, scale):
    """Normal (not batch-invariant) mode: SDPA over the cache slots `mask` [b, s, L] allows."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, cache_k, cache_v))  # [b, heads, s|L, d]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return out.transpose(1, 2)


def install_kv_cache(model: nn.Module) -> None:
    """Wrap each inner attention of `model` in a KVCacheAttention (idempotent)."""
    family = tm.family_of(model.config)
    if not family.kv_cache_generation:
        raise ValueError(f"model family {family.name!r} does not run with the KV cache (its Family sets "
                         f"kv_cache_generation=False): generate with vLLM or another generator")
    inners = [n for n, m in model.named_modules() if n.endswith(".attention.inner") and not isinstance(m, KVCacheAttention)]
    for name in inners:
        tm.override(model, name, lambda fqn, old: KVCacheAttention(old, fqn))
