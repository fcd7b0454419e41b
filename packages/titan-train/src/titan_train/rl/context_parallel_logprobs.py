"""The RL update's per-token logprobs with the sequence split over a context-parallel group.

Every cp rank holds the same samples. Each one runs the policy (whose attention is titan-train's
RingAttention over `group`, `apply_context_parallel`) on its share of every sequence in the load-balanced
layout of context_parallel.py, with those tokens' global positions, and gets the logprobs of the tokens
that follow them. The shares are all-gathered with autograd (`_GatherShares`) into the full [B, S-1]
logprobs, so the policy loss is computed on whole sequences, exactly as on one process, identically on
every cp rank.

Gradients: the gather's backward sums what all cp ranks' (identical) losses send back to a rank's share,
so each rank's parameter gradient is cp x the gradient of the loss through its own tokens (and, through
the ring, the keys and values it holds). The data-parallel average over the ranks (FSDP's reduce-scatter
divides by the world size, which counts the cp ranks) turns that into the single-process gradient;
without FSDP, `sum of the cp ranks' gradients / cp` is it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_rl import logprobs_from_logits

from ..context_parallel import local_indices, unshard_sequence


def cp_token_logprobs(model: nn.Module, tokens: torch.Tensor, *, group: dist.ProcessGroup, pad_id: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """tokens [B, S] (right-padded, the same on every cp rank) -> logprobs [B, S-1] of tokens[:, 1:], as
    `titan_rl.token_logprobs` on one process; differentiable through every rank's share."""
    return cp_token_logprobs_and_entropy(model, tokens, group=group, pad_id=pad_id, temperature=temperature)[0]


def cp_token_logprobs_and_entropy(model: nn.Module, tokens: torch.Tensor, *, group: dist.ProcessGroup,
                                  pad_id: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`cp_token_logprobs` and the entropy [B, S-1] of each next-token distribution (detached), as
    `titan_rl.token_logprobs_and_entropy` on one process."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, seq = tokens.shape
    padded = -(-seq // (2 * cp)) * (2 * cp)  # the layout cuts the sequence into 2 * cp equal chunks
    # labels[t] = tokens[t + 1]; positions past the sequence (padding) are dropped after the gather
    full = torch.full((batch, padded + 1), pad_id, dtype=tokens.dtype, device=tokens.device)
    full[:, :seq] = tokens
    inputs, labels = full[:, :padded], full[:, 1:]
    index = local_indices(rank, cp, padded, tokens.device)
    logits = model(inputs.index_select(1, index), positions=index.expand(batch, -1))  # [B, S_pad / cp, V]
    local = logprobs_from_logits(logits, labels.index_select(1, index), temperature=temperature)
    with torch.no_grad():
        scaled = logits.float() / (temperature if temperature not in (0.0, 1.0) else 1.0)
        logp = F.log_softmax(scaled, dim=-1)
        local_entropy = -(logp.exp() * logp).sum(-1)
        entropy = unshard_sequence(list(_GatherShares.apply(local_entropy, group).unbind(0)), cp)[:, :seq - 1]
    shares = _GatherShares.apply(local, group)
    return unshard_sequence(list(shares.unbind(0)), cp)[:, :seq - 1], entropy


class _GatherShares(torch.autograd.Function):
    """Every cp rank's share [B, s] stacked [cp, B, s]; the backward sums the gradient over the ranks
    (an all-reduce, which every backend has, gloo included) and keeps this rank's share of it."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        shares = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shares, local.contiguous(), group=group)
        return torch.stack(shares)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None

