"""Sampling settings and the next-token draw (temperature, nucleus / top-p)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    """max_new_tokens: completion length cap ("length" finish).
    temperature: 0 is greedy; logprobs are reported under softmax(logits / temperature) (T=1 when greedy).
    top_p: nucleus sampling mass (1.0 disables); logprobs ignore the truncation, as vLLM's do.
    stop_token_ids: ids that end a completion (included in it, with their logprob).
    stop_sequences: token-id sequences that end a completion once generated (included).
    seed: seeds the sampler's generator; None draws from torch's global RNG.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}; must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}; must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}; must be in (0, 1]")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences contains an empty sequence")


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= config.top_p, 0.0)  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
