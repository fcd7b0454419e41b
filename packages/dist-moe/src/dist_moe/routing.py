"""Token routing: top-k selection over softmax, sigmoid or sqrt-softplus scores, hash routing, expert
loads, load balancing.

Scores: softmax or sigmoid of the router logits, or sqrt(softplus(logits)) (DeepSeek-V4). Selection
uses `scores + bias` (the aux-loss-free balancing bias of DeepSeek-V3), optionally limited to the
`topk_group` best of `n_group` expert groups (a group's score is the sum of its two best experts);
the weights come from the *unbiased* scores of the chosen experts, renormalised when `norm_topk_prob`
and multiplied by `route_scale`. Hash routing (DeepSeek-V4's first layers) skips the selection: a
frozen table `tid2eid` [vocab, k] names each token id's experts (`hash_experts`), and only their
weights come from the scores. All routing math is float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

ScoreFunc = Literal["softmax", "sigmoid", "sqrtsoftplus"]
SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass(frozen=True)
class Routing:
    """weights [T, k] float32, expert_ids [T, k] int64, scores [T, E] float32 (unbiased)."""

    weights: Tensor
    expert_ids: Tensor
    scores: Tensor


def check_routing_args(*, num_experts: int, top_k: int, score_func: str, n_group: int, topk_group: int) -> None:
    """Raise ValueError naming the first routing argument that is out of range."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must be a positive divisor of num_experts={num_experts}, got {n_group}")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the kept groups "
            f"(topk_group={topk_group} x {num_experts // n_group} experts per group)"
        )


def route(
    logits: Tensor,
    *,
    top_k: int,
    score_func: ScoreFunc = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    route_scale: float = 1.0,
    bias: Tensor | None = None,
    hashed: Tensor | None = None,
) -> Routing:
    """Pick `top_k` experts per token from router logits [T, E]; see the module docstring. `hashed`
    [T, top_k] int64: the experts of hash routing (from `hash_experts`), taken as they are."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, num_experts], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    check_routing_args(num_experts=num_experts, top_k=top_k, score_func=score_func, n_group=n_group,
                       topk_group=topk_group)
    scores = routing_scores(logits, score_func)  # [T, E]
    if hashed is not None:
        if hashed.shape != (logits.shape[0], top_k):
            raise ValueError(f"hashed experts must be [tokens, top_k] = {(logits.shape[0], top_k)}, "
                             f"got {tuple(hashed.shape)}")
        return Routing(weights=_weights(scores, hashed, norm_topk_prob, route_scale), expert_ids=hashed, scores=scores)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.view(-1, n_group, per_group)  # [T, G, E/G]
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    expert_ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    return Routing(weights=_weights(scores, expert_ids, norm_topk_prob, route_scale), expert_ids=expert_ids,
                   scores=scores)


def routing_scores(logits: Tensor, score_func: str) -> Tensor:
    """Per-expert scores of router logits [T, E], in float32."""
    logits = logits.float()
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def _weights(scores: Tensor, expert_ids: Tensor, norm_topk_prob: bool, route_scale: float) -> Tensor:
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale


def hash_table(vocab_size: int, top_k: int, num_experts: int, *, device: torch.device | str | None = None) -> Tensor:
    """The fixed `tid2eid` [vocab_size, top_k] a hash layer holds until a checkpoint's: token t goes to
    experts t k .. t k + k - 1 (mod E), as titan-models' MoE initialises it."""
    return torch.arange(vocab_size * top_k, device=device).view(vocab_size, top_k) % num_experts


def hash_experts(tid2eid: Tensor, token_ids: Tensor) -> Tensor:
    """Hash routing's experts: tid2eid [vocab, k] int64 read at token_ids (any shape, T ids) -> [T, k]."""
    if tid2eid.dim() != 2:
        raise ValueError(f"tid2eid must be [vocab, top_k], got {tuple(tid2eid.shape)}")
    if token_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token_ids must be integer token ids, got {token_ids.dtype}")
    return tid2eid[token_ids.reshape(-1)].long()


def forced_balance(routing: Routing, *, norm_topk_prob: bool = True, route_scale: float = 1.0) -> Routing:
    """The same tokens dealt evenly to the experts, whatever the router chose (for measuring the layer at a
    perfectly balanced load): token t's j-th slot goes to expert (t * k + j) mod E, so the k experts of a
    token differ and every expert gets T k / E rows (within one). The weights are the router's unbiased
    scores of those experts (normalised and scaled as `route` does), so the router still learns."""
    tokens, top_k = routing.expert_ids.shape
    num_experts = routing.scores.shape[1]
    slots = torch.arange(tokens * top_k, device=routing.scores.device).view(tokens, top_k)
    expert_ids = slots % num_experts
    return Routing(weights=_weights(routing.scores, expert_ids, norm_topk_prob, route_scale), expert_ids=expert_ids,
                   scores=routing.scores)


def tokens_per_expert(expert_ids: Tensor, num_experts: int) -> Tensor:
    """Count routed rows per expert: expert_ids [T, k] (any shape) -> [num_experts] int64.

    scatter_add of ones instead of bincount: bincount on CUDA reads the maximum on the host.
    """
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


@torch.no_grad()
def update_expert_bias(bias: Tensor, tokens_per_expert: Tensor, *, rate: float,
                       group: dist.ProcessGroup | None = None) -> Tensor:
    """Aux-loss-free balancing: bias += rate * sign(mean load - load), in place; returns bias.

    Under data or expert parallelism each rank counts only its own tokens; pass the group over
    which the counts must be summed so every rank applies the same update.
    """
    load = tokens_per_expert.detach().to(torch.float32, copy=True)
    if group is not None:
        dist.all_reduce(load, group=group)
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
    return bias


def sequence_balance_loss(scores: Tensor, expert_ids: Tensor, *, alpha: float,
                          group: dist.ProcessGroup | None = None) -> Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over sequences.

    scores [b, s, E] (unbiased routing scores), expert_ids [b, s, k]. Per sequence:
    f_i = E / (k s) * #{tokens choosing i}, P_i = mean over tokens of scores normalised to sum 1,
    loss = alpha * sum_i f_i P_i (equal to alpha when the load is perfectly balanced).

    group: the ranks holding the other parts of the same b sequences, s tokens each (sequence-parallel
    ranks). The counts are summed over it (one all-reduce, outside autograd: f carries no gradient), and
    the loss returned is this rank's share, alpha * sum_i f_i * (its tokens' part of P_i): the shares, and
    their gradients, sum over the group to the loss of the whole sequences.
    """
    if scores.dim() != 3 or expert_ids.dim() != 3 or scores.shape[:2] != expert_ids.shape[:2]:
        raise ValueError(f"scores must be [b, s, E] and expert_ids [b, s, k] with the same b, s; got "
                         f"{tuple(scores.shape)} and {tuple(expert_ids.shape)}")
    batch, seq, num_experts = scores.shape
    top_k = expert_ids.shape[-1]
    chosen = torch.zeros(batch, num_experts, device=scores.device, dtype=torch.float32)
    chosen.scatter_add_(1, expert_ids.reshape(batch, -1), torch.ones(batch, seq * top_k, device=scores.device))
    parts = 1
    if group is not None:
        dist.all_reduce(chosen, group=group)
        parts = dist.get_world_size(group)
    fraction = chosen * (num_experts / (top_k * seq * parts))  # f_i [b, E] of the whole sequences
    probs = scores.float() / scores.float().sum(dim=-1, keepdim=True)
    mean_prob = probs.mean(dim=1) / parts  # this rank's tokens' part of P_i [b, E]
    return alpha * (fraction * mean_prob).sum(dim=-1).mean()
