"""Which keys a query may see: causal, optionally within one packed document and a sliding window.

One predicate serves every backend: the dense boolean mask of SDPA and the eager path, and the
`mask_mod` of flex_attention's block mask, so the backends cannot disagree on the pattern.
A window of W keeps the W most recent keys, the query's own included (`q - k < W`), as
Hugging Face's `sliding_window` does.
"""
from __future__ import annotations

import functools

import torch

from titan_models.context import AttentionContext


def visible(q_idx: torch.Tensor, kv_idx: torch.Tensor, *, window: int | None,
            document_ids: torch.Tensor | None = None, batch: torch.Tensor | None = None) -> torch.Tensor:
    """True where query q_idx may attend key kv_idx (broadcasting index tensors)."""
    allowed = q_idx >= kv_idx
    if window is not None:
        allowed = allowed & (q_idx - kv_idx < window)
    if document_ids is not None:
        allowed = allowed & (document_ids[batch, q_idx] == document_ids[batch, kv_idx])
    return allowed


def dense_mask(seq: int, device: torch.device, *, window: int | None,
               document_ids: torch.Tensor | None) -> torch.Tensor:
    """[b or 1, 1, s, s] bool mask for SDPA and the eager path."""
    idx = torch.arange(seq, device=device)
    if document_ids is None:
        return visible(idx[:, None], idx[None, :], window=window)[None, None]
    batch = torch.arange(document_ids.shape[0], device=device)[:, None, None]
    return visible(idx[None, :, None], idx[None, None, :], window=window, document_ids=document_ids,
                   batch=batch)[:, None]


def cached_dense_mask(seq: int, device: torch.device, *, window: int | None,
                      context: AttentionContext | None) -> torch.Tensor | None:
    """The dense mask, built once per context (None: plain causal, which SDPA expresses with is_causal)."""
    doc_ids = None if context is None else context.document_ids
    if doc_ids is None and window is None:
        return None
    if context is None:
        return dense_mask(seq, device, window=window, document_ids=None)
    key = ("dense_mask", seq, device, window, None if doc_ids is None else doc_ids.shape)
    return context.cached(key, lambda: dense_mask(seq, device, window=window, document_ids=doc_ids))


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


@functools.lru_cache(maxsize=16)
def _plain_block_mask(seq: int, device: torch.device, window: int | None):
    def mask_mod(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, window=window)

    return _create_block_mask(mask_mod, None, seq, device)


def block_mask(batch: int, seq: int, device: torch.device, *, window: int | None,
               context: AttentionContext | None):
    """flex_attention's BlockMask for the pattern (one per context when it carries documents)."""
    doc_ids = None if context is None else context.document_ids
    if doc_ids is None:
        return _plain_block_mask(seq, device, window)

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, window=window, document_ids=doc_ids, batch=b)

    key = ("flex_block_mask", batch, seq, device, window)
    return context.cached(key, lambda: _create_block_mask(mask_mod, batch, seq, device))
