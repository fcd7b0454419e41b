"""Grouped-query attention and the replaceable inner attentions (SDPA, flex_attention, eager).

An inner attention is a module `inner(q, k, v, *, context) -> out` with q [b, s, hq, d],
k/v [b, s, hkv, d] (hq a multiple of hkv) and out [b, s, hq, d_v]; it applies the causal mask,
its `sliding_window` (None: none) and the document mask from `context.document_ids`. A generator
replaces it to own a KV cache. Attention with sinks (gpt-oss) also passes `sinks=` [hq], a learned
logit per head in the softmax denominator: flex folds it in exactly from its log-sum-exp, the eager
path concatenates it to the scores, and SDPA, which cannot express it, runs the eager path.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.attention_masks import block_mask, cached_dense_mask, dense_mask
from titan_models.components.norms import NormConfig
from titan_models.components.projections import project
from titan_models.components.rope import apply_rotary
from titan_models.components.sinks import AttentionSinks, eager_attention, fold_sinks
from titan_models.context import AttentionContext

AttentionBackend = Literal["sdpa", "flex", "eager"]
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "flex", "eager")


def build_inner_attention(backend: str, *, scale: float, sliding_window: int | None = None) -> nn.Module:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of keys or None, got {sliding_window}")
    if backend == "sdpa":
        return SDPAttention(scale=scale, sliding_window=sliding_window)
    if backend == "flex":
        return FlexAttention(scale=scale, sliding_window=sliding_window)
    if backend == "eager":
        return EagerAttention(scale=scale, sliding_window=sliding_window)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int | None,
          context: AttentionContext | None) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    gqa = q.shape[1] != k.shape[1]
    mask = cached_dense_mask(q.shape[2], q.device, window=window, context=context)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


class _InnerAttention(nn.Module):
    """What every inner attention holds: the softmax scale and the sliding window (None: full causal)."""

    def __init__(self, *, scale: float, sliding_window: int | None = None):
        super().__init__()
        self.scale = scale
        self.sliding_window = sliding_window

    def extra_repr(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return f"scale={self.scale:.6g}{window}"

    def prepare_mask(self, batch: int, seq: int, device: torch.device, context: AttentionContext | None) -> None:
        """Build (and cache) this pattern's mask ahead of the blocks; see prepare_masks."""
        if context is not None and context.document_ids is not None:
            cached_dense_mask(seq, device, window=self.sliding_window, context=context)


def prepare_masks(model: nn.Module, batch: int, seq: int, device: torch.device,
                  context: AttentionContext | None) -> None:
    """Build every attention pattern's mask before the first block runs. Built lazily inside a block,
    the first block would create it in its forward and find it cached when recomputed under activation
    checkpointing, and the recomputation would no longer match the forward it replays. Only training
    forwards are checkpointed: without autograd (generation, evaluation) masks stay lazy."""
    if not torch.is_grad_enabled():
        return
    seen = set()
    for module in model.modules():
        if isinstance(module, _InnerAttention) and (type(module), module.sliding_window) not in seen:
            seen.add((type(module), module.sliding_window))
            module.prepare_mask(batch, seq, device, context)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int | None,
           context: AttentionContext | None, sinks: torch.Tensor | None) -> torch.Tensor:
    mask = cached_dense_mask(q.shape[1], q.device, window=window, context=context)
    if mask is None:
        mask = dense_mask(q.shape[1], q.device, window=None, document_ids=None)
    return eager_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def _sdpa_or_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int | None,
                   context: AttentionContext | None, sinks: torch.Tensor | None) -> torch.Tensor:
    if sinks is not None:  # SDPA has no term for sinks
        return _eager(q, k, v, scale=scale, window=window, context=context, sinks=sinks)
    return _sdpa(q, k, v, scale=scale, window=window, context=context)


class EagerAttention(_InnerAttention):
    """Scores materialised [b, h, s, s], masked, softmaxed with the sinks in the denominator (see
    components/sinks.py): the reference path, and what SDPA falls back to when there are sinks."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context: AttentionContext | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        return _eager(q, k, v, scale=self.scale, window=self.sliding_window, context=context, sinks=sinks)


class SDPAttention(_InnerAttention):
    """torch's scaled_dot_product_attention: causal, or a dense causal (+window, +document) mask.
    SDPA has no term for attention sinks, so with sinks it runs the eager path (EagerAttention)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context: AttentionContext | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        return _sdpa_or_eager(q, k, v, scale=self.scale, window=self.sliding_window, context=context, sinks=sinks)


_compiled_flex = None


def _flex_attention():
    """flex_attention is only fused under torch.compile; compile it once, for CUDA only (the
    eager fallback is exact and keeps CPU tests free of compile time)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexAttention(_InnerAttention):
    """torch's flex_attention with a block mask of the causal (+window, +document) pattern, built
    once per context. Sinks are folded in from the log-sum-exp flex returns (fold_sinks, exact).
    On CPU with autograd (which flex_attention lacks there) it computes the same masks with SDPA,
    or with the eager path when there are sinks."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context: AttentionContext | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        if not q.is_cuda and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (q, k, v, sinks)):
            # flex_attention has no CPU backward; the same masks through SDPA/eager give the same result.
            return _sdpa_or_eager(q, k, v, scale=self.scale, window=self.sliding_window, context=context,
                                  sinks=sinks)
        batch, seq = q.shape[:2]
        mask = block_mask(batch, seq, q.device, window=self.sliding_window, context=context)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        kwargs = dict(block_mask=mask, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1],
                      return_aux=AuxRequest(lse=True) if sinks is not None else None)
        if q.is_cuda:
            out = _flex_attention()(q, k, v, **kwargs)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                out = flex_attention(q, k, v, **kwargs)
        if sinks is not None:
            out, aux = out
            out = fold_sinks(out, aux.lse, sinks)
        return out.transpose(1, 2)

    def prepare_mask(self, batch: int, seq: int, device: torch.device, context: AttentionContext | None) -> None:
        if device.type == "cuda":  # elsewhere the training forward takes the SDPA path (no flex backward)
            block_mask(batch, seq, device, window=self.sliding_window, context=context)
        else:
            super().prepare_mask(batch, seq, device, context)


@dataclass(kw_only=True, frozen=True)
class AttentionConfig:
    """Grouped-query attention. `qk_norm` adds per-head norms on q and k before RoPE (Qwen3).
    `output_gate` makes the query projection also produce a per-channel gate: each head's rows of
    `wq` are [query (head_dim) | gate (head_dim)], and the attention output is multiplied by
    sigmoid(gate) before `wo` (Qwen3-Next / Qwen3.5 gated attention). With `output_gate_source="projection"`
    the gate comes from its own projection `wg` of the attention's input instead (Muse).
    `rotary=False` leaves q/k unrotated (NoPE layers); `query_scale` multiplies the softmax scale
    head_dim^-1/2 (Muse's `qk_scale_factor` after its scaleless QK-norm); `output_norm` normalises each
    head's output before the gate (Muse Spark's `o_norm`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: NormConfig | None = None
    output_gate: bool = False
    output_gate_source: Literal["query", "projection"] = "query"
    rotary: bool = True
    query_scale: float = 1.0
    output_norm: NormConfig | None = None
    backend: AttentionBackend = "sdpa"
    bias: bool = False  # biases on the q/k/v/o projections (gpt-oss)
    sinks: bool = False  # a learned per-head sink logit in the softmax denominator (gpt-oss)
    sliding_window: int | None = None  # attend to the last `sliding_window` keys only (itself included)

    def build(self, dim: int) -> "Attention":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.output_gate_source not in ("query", "projection"):
            raise ValueError(f"output_gate_source must be 'query' or 'projection', got {self.output_gate_source!r}")
        if self.query_scale <= 0:
            raise ValueError(f"query_scale must be positive, got {self.query_scale}")
        return Attention(dim, self)


class Attention(nn.Module):
    def __init__(self, dim: int, config: AttentionConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.score_dims = (config.num_heads, config.head_dim, config.head_dim)  # for FLOP counting
        self.sliding_window = config.sliding_window  # for FLOP counting (keys per query)
        self.output_gate = config.output_gate
        self.rotary = config.rotary
        fused_gate = config.output_gate and config.output_gate_source == "query"
        q_rows = config.num_heads * config.head_dim * (2 if fused_gate else 1)
        self.wq = nn.Linear(dim, q_rows, bias=config.bias)
        self.wk = nn.Linear(dim, config.num_kv_heads * config.head_dim, bias=config.bias)
        self.wv = nn.Linear(dim, config.num_kv_heads * config.head_dim, bias=config.bias)
        self.wo = nn.Linear(config.num_heads * config.head_dim, dim, bias=config.bias)
        self.sinks = AttentionSinks(config.num_heads) if config.sinks else None
        self.wg = (nn.Linear(dim, config.num_heads * config.head_dim, bias=False)
                   if config.output_gate and not fused_gate else None)
        self.out_norm = config.output_norm.build(config.head_dim) if config.output_norm is not None else None
        if config.qk_norm is not None:
            self.q_norm = config.qk_norm.build(config.head_dim)
            self.k_norm = config.qk_norm.build(config.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.inner = build_inner_attention(config.backend, scale=config.head_dim**-0.5 * config.query_scale,
                                           sliding_window=config.sliding_window)

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
        if self.wg is not None:
            gate = self.wg(x).view(batch, seq, -1, self.head_dim)
        elif self.output_gate:  # per head [query | gate], so a colwise shard keeps whole heads
            q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q, k, v = (t.reshape(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.sinks is None:
            out = self.inner(q, k, v, context=context)  # [b, s, hq, d]
        else:
            out = self.inner(q, k, v, context=context, sinks=self.sinks())
        if self.out_norm is not None:
            out = self.out_norm(out)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(batch, seq, -1))
