"""The KV cache: a generation context and the inner-attention override that owns the cache.

`install_kv_cache(model)` wraps every `layers.N.attention.inner` (through titan-models' `override`)
in a `KVCacheAttention`. Called with an ordinary context (or none), the wrapper is transparent (the
trainer's forward is unchanged); called with a `GenerationContext`, it writes this step's k/v into the
cache at the tokens' positions and attends over the cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import titan_models as tm
import torch
import torch.nn.functional as F
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context=None) -> torch.Tensor:
        if not isinstance(context, GenerationContext):
            return self.base(q, k, v, context=context)
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
            return attend(q, cache_k, cache_v, q_positions=context.positions, kv_len=context.kv_len)
        return _sdpa_over_cache(q, cache_k, cache_v, context.positions, context.kv_len, self.base.scale)


def _sdpa_over_cache(q, cache_k, cache_v, positions, kv_len, scale):
    """Normal (not batch-invariant) mode: SDPA with a mask slot <= position and slot < kv_len."""
    slots = torch.arange(cache_k.shape[1], device=q.device)
    mask = (slots[None, None, :] <= positions[:, :, None]) & (slots[None, None, :] < kv_len[:, None, None])
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
