"""Per-token log-probabilities, computed the same way by the trainer and the built-in generator."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_rl.batch_invariant import is_batch_invariant, ops


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                         batch_invariant: bool = False) -> torch.Tensor:
    """logits [..., V], tokens [...] -> log p(token) under softmax(logits / temperature), float32.

    temperature 0 (greedy sampling) reports the temperature-1 distribution.

    The log-softmax is torch's on CPU in both modes: its CPU kernel reduces each row on its own with an
    order fixed by the row length (tests/test_batch_invariant_ops.py checks this), and it is the op
    vLLM's sampler uses, so trainer and vLLM logprobs can agree bitwise. On CUDA, batch-invariant mode
    uses titan-rl's Triton log-softmax."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature}; must be >= 0")
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    if batch_invariant and logits.is_cuda:
        logp = ops.log_softmax(logits)
    else:
        logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens[..., None].long()).squeeze(-1)


def token_logprobs(model: nn.Module, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """The trainer's view: one forward over full sequences tokens [B, S] (right-padded) ->
    logprobs [B, S-1] of tokens[:, 1:] given their prefixes. Differentiable."""
    logits = model(tokens)[:, :-1]
    return logprobs_from_logits(logits, tokens[:, 1:], temperature=temperature, batch_invariant=is_batch_invariant(model))


def token_logprobs_and_entropy(model: nn.Module, tokens: torch.Tensor, *, temperature: float = 1.0
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` (differentiable) and, from the same forward, the entropy [B, S-1] (detached, float32) of
    each next-token distribution softmax(logits / temperature) (temperature 0: 1), the sampling distribution
    before top-p: a collapsing policy shows as entropy falling towards 0."""
    logits = model(tokens)[:, :-1]
    logprobs = logprobs_from_logits(logits, tokens[:, 1:], temperature=temperature,
                                    batch_invariant=is_batch_invariant(model))
    with torch.no_grad():
        scaled = logits.float()
        if temperature not in (0.0, 1.0):
            scaled = scaled / temperature
        logp = F.log_softmax(scaled, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy
