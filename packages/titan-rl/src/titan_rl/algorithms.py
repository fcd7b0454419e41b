"""Algorithm presets: how rewards become advantages, which groups are kept, and the loss."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from titan_rl.losses import AdvantageScale, PolicyLossConfig, group_advantages, informative_groups


@dataclass(kw_only=True, frozen=True)
class AlgorithmConfig:
    """A GRPO-family algorithm: `grpo()`, `dapo()` and `gspo()` give the published settings.

    group_size: completions sampled per prompt (advantages are normalised within a group).
    advantage_scale: "std" (GRPO) or "none".
    drop_uninformative_groups: DAPO's dynamic sampling: groups whose rewards are all equal are dropped
      (the loop samples more prompts to refill the batch, up to `max_refill_rounds`).
    loss: the clipped surrogate (ratio level, clip range, aggregation, KL, TIS).
    """

    name: str = "grpo"
    group_size: int = 8
    advantage_scale: AdvantageScale = "std"
    drop_uninformative_groups: bool = False
    max_refill_rounds: int = 3
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}; group-normalised advantages need >= 2 samples per prompt")
        if self.max_refill_rounds < 0:
            raise ValueError(f"max_refill_rounds={self.max_refill_rounds}; must be >= 0")

    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rewards [G, n] -> (advantages [G, n], keep [G] bool)."""
        if rewards.shape[1] != self.group_size:
            raise ValueError(f"rewards have {rewards.shape[1]} samples per group; config says group_size={self.group_size}")
        keep = informative_groups(rewards) if self.drop_uninformative_groups else torch.ones(rewards.shape[0], dtype=torch.bool)
        return group_advantages(rewards, scale=self.advantage_scale), keep


def grpo(**overrides) -> AlgorithmConfig:
    """GRPO: token ratios clipped at 1 +- 0.2, std-normalised group advantages, per-sequence token mean."""
    return _with(AlgorithmConfig(name="grpo", loss=PolicyLossConfig(clip_low=0.2, clip_high=0.2, aggregation="sequence_mean")), overrides)


def dapo(**overrides) -> AlgorithmConfig:
    """DAPO: clip-higher (0.2 / 0.28), dynamic sampling, token-level loss aggregation, no KL."""
    return _with(AlgorithmConfig(name="dapo", drop_uninformative_groups=True,
                                 loss=PolicyLossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean", kl_coef=0.0)),
                 overrides)


def gspo(**overrides) -> AlgorithmConfig:
    """GSPO: sequence-level ratio (geometric mean of token ratios) clipped at 1 - 3e-4 / 1 + 4e-4."""
    return _with(AlgorithmConfig(name="gspo", loss=PolicyLossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                                                                    aggregation="sequence_mean")), overrides)


def _with(config: AlgorithmConfig, overrides: dict) -> AlgorithmConfig:
    loss_fields = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    top_fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    unknown = set(overrides) - loss_fields - top_fields
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; allowed: {sorted((loss_fields | top_fields) - {'loss'})}")
    loss_over = {k: v for k, v in overrides.items() if k in loss_fields}
    top_over = {k: v for k, v in overrides.items() if k in top_fields}
    loss = top_over.pop("loss", config.loss)
    return dataclasses.replace(config, loss=dataclasses.replace(loss, **loss_over), **top_over)
