"""GRPO-family policy losses: GRPO, DAPO, GSPO, with optional k3 KL and truncated importance sampling.

Three log-probabilities of each sampled token meet here:

- `logprobs`: the policy being trained (carries the gradient);
- `old_logprobs`: the trainer's policy at the start of this step (PPO's "old" policy; the clip is
  measured against it). None means one update per batch, where old == current (detached);
- `behavior_logprobs`: what the generator reported when it sampled the token. It differs from
  `old_logprobs` when the generator is another engine (numerical mismatch) or ran an older policy
  version (asynchronous rollouts). The ratio old / behavior, truncated at `tis_cap` and detached,
  reweights each token so that the gradient is an unbiased-up-to-truncation estimate under the old policy.

Shapes: B sequences, T completion tokens (right-padded), `mask` [B, T] is 1 on real completion tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "sequence_mean"]
AdvantageScale = Literal["std", "none"]


@dataclass(kw_only=True, frozen=True)
class PolicyLossConfig:
    """One PPO-style clipped surrogate, parameterised to cover GRPO, DAPO and GSPO.

    ratio_level: "token" (GRPO, DAPO) or "sequence" (GSPO: the geometric mean of token ratios).
    clip_low / clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO: asymmetric).
    aggregation: "token_mean" averages over every completion token in the batch (DAPO: long answers
      weigh by their length); "sequence_mean" averages each sequence's token mean (GRPO, GSPO).
    kl_coef: weight of the k3 estimator of KL(policy || reference) in the loss; 0 leaves it out (the metric
      "kl" is reported whenever ref_logprobs are given).
    tis_cap: truncation C of the importance weight min(old / behavior, C); None disables it.
    """

    ratio_level: RatioLevel = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: Aggregation = "sequence_mean"
    kl_coef: float = 0.0
    tis_cap: float | None = 2.0

    def __post_init__(self) -> None:
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level={self.ratio_level!r}; allowed: 'token', 'sequence'")
        if self.aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError(f"aggregation={self.aggregation!r}; allowed: 'token_mean', 'sequence_mean'")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ValueError(f"clip_low={self.clip_low}, clip_high={self.clip_high}; need 0 <= clip_low < 1, clip_high >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef}; must be >= 0")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap={self.tis_cap}; must be >= 1 or None")


@dataclass(kw_only=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, float]


def policy_loss(
    config: PolicyLossConfig,
    *,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The clipped surrogate loss; `advantages` is [B] (one per sequence) or [B, T]."""
    _check_shapes(config, logprobs=logprobs, mask=mask, old_logprobs=old_logprobs,
                  behavior_logprobs=behavior_logprobs, ref_logprobs=ref_logprobs)
    advantages = _per_token_advantages(advantages, logprobs)

    # Compute in float32 at least: bf16 ratios of nearly equal logprobs lose the clip boundary.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = mask.to(dtype)
    logprobs = logprobs.to(dtype)
    advantages = advantages.to(dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(dtype)
    tokens_per_seq = mask.sum(-1).clamp_min(1)  # [B]

    ratio = _policy_ratio(config, logprobs, old, mask, tokens_per_seq)
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    per_token = -surrogate

    metrics: dict[str, float] = {}
    if behavior_logprobs is not None and config.tis_cap is not None:
        weight, tis_metrics = _truncated_is_weight(config, old, behavior_logprobs.to(dtype), mask, tokens_per_seq)
        per_token = per_token * weight
        metrics.update(tis_metrics)

    if ref_logprobs is not None:  # measured whenever a reference is given; in the loss only with kl_coef > 0
        kl = _k3_kl(ref_logprobs.to(dtype), logprobs)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)

    loss = _aggregate(config, per_token * mask, mask, tokens_per_seq)
    metrics.update(_clip_metrics(config, ratio, advantages, mask))
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _check_shapes(
    config: PolicyLossConfig,
    *,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    behavior_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
) -> None:
    """Every per-token input must be [B, T] like `logprobs`; the KL term needs `ref_logprobs`."""
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs and mask must both be [B, T]; got {tuple(logprobs.shape)} and {tuple(mask.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("behavior_logprobs", behavior_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(logprobs.shape)} like logprobs")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")


def _per_token_advantages(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[B] advantages broadcast over each sequence's tokens; [B, T] ones pass through."""
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(logprobs)
    if advantages.shape != logprobs.shape:
        raise ValueError(f"advantages must be [B] or [B, T]; got {tuple(advantages.shape)}")
    return advantages


def _policy_ratio(
    config: PolicyLossConfig, logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, tokens_per_seq: torch.Tensor
) -> torch.Tensor:
    """pi / pi_old per token, or (GSPO) the geometric mean over each sequence repeated on its tokens."""
    log_ratio = (logprobs - old) * mask
    if config.ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / tokens_per_seq  # [B]
        return torch.exp(seq_log_ratio)[:, None].expand_as(logprobs)
    return torch.exp(log_ratio)


def _truncated_is_weight(
    config: PolicyLossConfig, old: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, tokens_per_seq: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached weight min(old / behavior, tis_cap) (per sequence under GSPO) and its metrics."""
    log_w = ((old - behavior) * mask).detach()
    if config.ratio_level == "sequence":
        log_w = (log_w.sum(-1) / tokens_per_seq)[:, None].expand_as(old)
    weight = torch.exp(log_w).clamp(max=config.tis_cap)
    metrics = {
        "tis_weight_mean": _masked_mean(weight, mask),
        "tis_truncated_frac": _masked_mean((torch.exp(log_w) > config.tis_cap).to(mask.dtype), mask),
    }
    return weight, metrics


def _k3_kl(ref: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased for KL(pi || ref), always >= 0."""
    delta = ref - logprobs
    return torch.exp(delta) - delta - 1


def _aggregate(
    config: PolicyLossConfig, per_token: torch.Tensor, mask: torch.Tensor, tokens_per_seq: torch.Tensor
) -> torch.Tensor:
    """The scalar loss from masked per-token losses: a mean over all tokens, or of per-sequence means."""
    if config.aggregation == "token_mean":
        return per_token.sum() / mask.sum().clamp_min(1)
    return (per_token.sum(-1) / tokens_per_seq).mean()


def _clip_metrics(
    config: PolicyLossConfig, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The fraction of tokens whose gradient the clip removed, and the mean ratio."""
    with torch.no_grad():
        was_clipped = ((ratio < 1 - config.clip_low) & (advantages < 0)) | ((ratio > 1 + config.clip_high) & (advantages > 0))
        return {
            "clip_frac": _masked_mean(was_clipped.to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio.detach(), mask),
        }


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp_min(1))


def group_advantages(rewards: torch.Tensor, *, scale: AdvantageScale = "std", eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] (G prompts, n samples each) -> advantages [G, n]: reward minus its group mean,
    divided by the group's standard deviation (unbiased, as torch.std) when scale == "std"
    (GRPO) or left unscaled when scale == "none" (Dr. GRPO: the std rescaling biases towards easy prompts)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, samples_per_group] with >= 2 samples; got {tuple(rewards.shape)}")
    if scale not in ("std", "none"):
        raise ValueError(f"scale={scale!r}; allowed: 'std', 'none'")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: rewards [G, n] -> bool [G], False for groups whose samples all
    got the same reward (their advantages are all zero, so they would only dilute the batch)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group]; got {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)
