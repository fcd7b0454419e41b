"""What every inner attention receives besides q, k and v."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(kw_only=True)
class AttentionContext:
    """Per-forward information handed unchanged to every inner attention.

    `document_ids` [batch, seq] marks packed documents: attention never crosses a boundary between
    two ids. A generator subclasses this to carry its KV-cache bookkeeping.

    `recurrent_states`, when set, is where recurrent layers (Gated DeltaNet) keep their decode state
    between forwards: each layer starts from `recurrent_states[layer]` (absent: zeros) and stores
    its state after the last token there (see components/gated_deltanet.py). A generator keeps the
    same dict from prefill through decode; None (training) carries nothing.
    """

    document_ids: torch.Tensor | None = None
    recurrent_states: dict[Any, Any] | None = None
    # [b, s] bool, False at right padding after a row's tokens: recurrent layers carry their state over
    # those positions unchanged (attention needs nothing: causality keeps real tokens from seeing them).
    valid_tokens: torch.Tensor | None = None
    # Masks derived from document_ids are the same for every layer, so the first layer builds
    # them and the others reuse them (a fresh context per forward keeps this cache correct).
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
