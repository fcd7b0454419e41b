"""Grouped-query attention and the replaceable inner attentions (SDPA, flex_attention).

An inner attention is a module `inner(q, k, v, *, context) -> out` with q [b, s, hq, d],
k/v [b, s, hkv, d] (hq a multiple of hkv) and out [b, s, hq, d_v]; it applies the causal mask and
the document mask from `context.document_ids`. A generator replaces it to own a KV cache.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.norms import NormConfig
from titan_models.components.projections import project
from titan_models.components.rope import apply_rotary
from titan_models.context import AttentionContext

AttentionBackend = Literal["sdpa", "flex"]
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "flex")


def build_inner_attention(backend: str, *, scale: float) -> nn.Module:
    if backend == "sdpa":
        return SDPAttention(scale=scale)
    if backend == "flex":
        return FlexAttention(scale=scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")


def _document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids -> [b, 1, s, s] bool, True where query i may attend key j (causal, same document)."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
          context: AttentionContext | None) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    gqa = q.shape[1] != k.shape[1]
    doc_ids = None if context is None else context.document_ids
    if doc_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = context.cached(("dense_mask", doc_ids.shape, doc_ids.device), lambda: _document_mask(doc_ids))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


class SDPAttention(nn.Module):
    """torch's scaled_dot_product_attention: causal, or a dense causal+document mask when
    the context carries document ids."""

    def __init__(self, *, scale: float):
        super().__init__()
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context: AttentionContext | None = None
    ) -> torch.Tensor:
        return _sdpa(q, k, v, scale=self.scale, context=context)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"


_compiled_flex = None


def _flex_attention():
    """flex_attention is only fused under torch.compile; compile it once, for CUDA only (the
    eager fallback is exact and keeps CPU tests free of compile time)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=16)
def _causal_block_mask(seq: int, device: torch.device):
    return _create_block_mask(_causal, None, seq, device)


_compiled_create_block_mask = None


def _create_block_mask(mask_mod, batch: int | None, seq: int, device: torch.device):
    """Compiled on CUDA (the eager version materialises the full seq x seq mask)."""
    global _compiled_create_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if device.type != "cuda":
        return create_block_mask(mask_mod, batch, None, seq, seq, device=device)
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_create_block_mask(mask_mod, batch, None, seq, seq, device=device)


class FlexAttention(nn.Module):
    """torch's flex_attention with a causal block mask, intersected with the document mask
    when the context carries document ids (the block mask is built once per context).
    On CPU with autograd (which flex_attention lacks there) it computes the same masks with SDPA."""

    def __init__(self, *, scale: float):
        super().__init__()
        self.scale = scale

    @staticmethod
    def _block_mask(batch: int, seq: int, device: torch.device, document_ids: torch.Tensor):
        def doc_mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

        return _create_block_mask(doc_mask_mod, batch, seq, device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context: AttentionContext | None = None
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            # flex_attention has no CPU backward; the same masks through SDPA give the same result.
            return _sdpa(q, k, v, scale=self.scale, context=context)
        batch, seq = q.shape[:2]
        doc_ids = None if context is None else context.document_ids
        key = ("flex_block_mask", batch, seq, q.device)  # one document mask per context
        if context is None or doc_ids is None:
            block_mask = _causal_block_mask(seq, q.device)
        else:
            block_mask = context.cached(key, lambda: self._block_mask(batch, seq, q.device, doc_ids))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        gqa = q.shape[1] != k.shape[1]
        if q.is_cuda:
            out = _flex_attention()(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=gqa)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                out = flex_attention(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"


@dataclass(kw_only=True, frozen=True)
class AttentionConfig:
    """Grouped-query attention. `qk_norm` adds per-head norms on q and k before RoPE (Qwen3).
    `output_gate` makes the query projection also produce a per-channel gate: each head's rows of
    `wq` are [query (head_dim) | gate (head_dim)], and the attention output is multiplied by
    sigmoid(gate) before `wo` (Qwen3-Next / Qwen3.5 gated attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: NormConfig | None = None
    output_gate: bool = False
    backend: AttentionBackend = "sdpa"

    def build(self, dim: int) -> "Attention":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return Attention(dim, self)


class Attention(nn.Module):
    def __init__(self, dim: int, config: AttentionConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.score_dims = (config.num_heads, config.head_dim, config.head_dim)  # for FLOP counting
        self.output_gate = config.output_gate
        q_rows = config.num_heads * config.head_dim * (2 if config.output_gate else 1)
        self.wq = nn.Linear(dim, q_rows, bias=False)
        self.wk = nn.Linear(dim, config.num_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(dim, config.num_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * config.head_dim, dim, bias=False)
        if config.qk_norm is not None:
            self.q_norm = config.qk_norm.build(config.head_dim)
            self.k_norm = config.qk_norm.build(config.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.inner = build_inner_attention(config.backend, scale=config.head_dim**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        *,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads are inferred (-1) so a tensor-parallel shard with fewer local heads runs unchanged.
        q, k, v = project(x, self.wq, self.wk, self.wv)
        gate = None
        if self.output_gate:  # per head [query | gate], so a colwise shard keeps whole heads
            q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q, k, v = (t.reshape(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.inner(q, k, v, context=context)  # [b, s, hq, d]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(batch, seq, -1))
