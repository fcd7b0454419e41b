"""The RL loop on one process: rollouts -> advantages -> clipped policy loss -> optimizer step -> weight sync.

    loop = RLLoop(policy=model, optimizer=opt, generator=gen, make_env=lambda: SingleTurn(SortingTask()),
                  tokenizer=tok, config=RLConfig(algorithm=grpo(group_size=8), ...))
    for step in range(100):
        metrics = loop.step()

The loop owns no distributed code: a distributed trainer (titan-train) wraps `policy` (FSDP etc.)
before handing it over, and `train_on_batch` is the piece it reuses with its own rollout source.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_rl.algorithms import AlgorithmConfig, grpo
from titan_rl.envs.base import Environment
from titan_rl.generation.base import Generator
from titan_rl.generation.sampling import SamplingConfig
from titan_rl.logprobs import token_logprobs, token_logprobs_and_entropy
from titan_rl.losses import policy_loss
from titan_rl.rollout import AsyncRollouts, RolloutBatch, Sample, collect_rollouts
from titan_rl.tokenizer import Tokenizer


@dataclass(kw_only=True, frozen=True)
class RLConfig:
    """prompts_per_step: groups per batch (each of algorithm.group_size samples).
    max_policy_lag: 0 = synchronous on-policy; k > 0 = rollouts generated in a background thread
      while training, from weights at most k versions old (older batches are dropped).
    max_turns: turns per episode (1 for single-turn tasks, more for tool-calling environments).
    minibatches: optimizer steps per rollout batch (the PPO "old" policy is the batch's start).
    max_grad_norm: gradient clipping (None disables).
    track_kl: keep a reference (the policy as it starts) even when the loss has no KL term, so that every
      step reports the KL to it ("kl"; one more forward per step). With kl_coef > 0 there is always one.
    """

    algorithm: AlgorithmConfig = field(default_factory=grpo)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts_per_step: int = 8
    max_policy_lag: int = 0
    max_turns: int = 1
    minibatches: int = 1
    max_grad_norm: float | None = 1.0
    seed: int = 0
    track_kl: bool = True

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.minibatches < 1 or self.max_turns < 1:
            raise ValueError(f"prompts_per_step, minibatches and max_turns must be >= 1; got "
                             f"{self.prompts_per_step}, {self.minibatches}, {self.max_turns}")
        if self.max_policy_lag < 0:
            raise ValueError(f"max_policy_lag={self.max_policy_lag}; must be >= 0")


@dataclass(kw_only=True)
class TrainBatch:
    """Right-padded tensors for the loss. tokens [N, S]; the others [N, S-1], aligned with the
    logprobs of tokens[:, 1:]."""

    tokens: torch.Tensor
    mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor  # [N]

    @staticmethod
    def from_samples(samples: list[Sample], advantages: list[float], *, pad_id: int, device: torch.device) -> "TrainBatch":
        S = max(len(s.prompt) + len(s.completion) for s in samples)
        N = len(samples)
        tokens = torch.full((N, S), pad_id, dtype=torch.long)
        mask = torch.zeros(N, S - 1)
        behavior = torch.zeros(N, S - 1)
        for i, s in enumerate(samples):
            P, C = len(s.prompt), len(s.completion)
            tokens[i, :P + C] = torch.tensor(s.prompt + s.completion)
            # logprob index t scores tokens[t + 1]: the completion starts at index P - 1
            mask[i, P - 1:P - 1 + C] = torch.tensor(s.loss_mask, dtype=torch.float32)
            behavior[i, P - 1:P - 1 + C] = s.behavior_logprobs
        return TrainBatch(tokens=tokens.to(device), mask=mask.to(device), behavior_logprobs=behavior.to(device),
                          advantages=torch.tensor(advantages, dtype=torch.float32, device=device))


class RLLoop:
    def __init__(self, *, policy: nn.Module, optimizer: torch.optim.Optimizer, generator: Generator,
                 make_env: Callable[[], Environment], tokenizer: Tokenizer, config: RLConfig,
                 reference: nn.Module | None = None,
                 export_weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        """reference: the frozen policy for the KL term and metric (default: a copy of `policy` as it starts,
        made when kl_coef > 0 or config.track_kl). export_weights: full (unsharded) tensors for the generator
        after each step; default `policy.state_dict()` (a sharded trainer passes e.g. a full-state-dict gather)."""
        if config.max_policy_lag > 0 and getattr(generator, "model", None) is policy:
            raise ValueError("max_policy_lag > 0 generates while the policy trains: give the generator its own "
                             "weights (BuiltinGenerator(policy, copy_model=True) or a vLLM generator)")
        self.policy, self.optimizer, self.generator = policy, optimizer, generator
        self.export_weights = export_weights
        self.tokenizer, self.config, self.make_env = tokenizer, config, make_env
        self.version = generator.policy_version
        self.device = next(policy.parameters()).device
        self.pad_id = getattr(tokenizer, "pad_id", tokenizer.eos_id)
        self.sampling = config.sampling
        if tokenizer.eos_id not in self.sampling.stop_token_ids:
            self.sampling = SamplingConfig(**{**config.sampling.__dict__,
                                              "stop_token_ids": (*config.sampling.stop_token_ids, tokenizer.eos_id)})
        if (config.algorithm.loss.kl_coef > 0 or config.track_kl) and reference is None:
            reference = copy.deepcopy(policy).requires_grad_(False)  # the policy as it starts
        self.reference = reference
        self.rollouts = AsyncRollouts(self._produce, max_policy_lag=config.max_policy_lag,
                                      groups_per_batch=config.prompts_per_step)
        self.step_count = 0

    def _produce(self, first_group: int) -> RolloutBatch:
        seeds = [self.config.seed * 1_000_003 + first_group + g for g in range(self.config.prompts_per_step)]
        return collect_rollouts(make_env=self.make_env, seeds=seeds, group_size=self.config.algorithm.group_size,
                                generator=self.generator, tokenizer=self.tokenizer, sampling=self.sampling,
                                max_turns=self.config.max_turns, first_group=first_group)

    def close(self) -> None:
        self.rollouts.close()

    def step(self) -> dict[str, float]:
        """One rollout batch, `minibatches` optimizer steps, a weight sync; returns the step's metrics."""
        algo = self.config.algorithm
        dropped_before = self.rollouts.stats.dropped_samples
        batch = self.rollouts.get(self.version)
        samples = batch.samples
        groups = sorted({s.group for s in samples})
        rewards = torch.tensor([[s.reward for s in samples if s.group == g] for g in groups])  # [G, n]
        advantages, keep = algo.advantages(rewards)
        refills = 0
        while algo.drop_uninformative_groups and not bool(keep.any()) and refills < algo.max_refill_rounds:
            # Dynamic sampling: every group was uninformative; draw a fresh batch.
            refills += 1
            batch = self.rollouts.get(self.version)
            samples = batch.samples
            groups = sorted({s.group for s in samples})
            rewards = torch.tensor([[s.reward for s in samples if s.group == g] for g in groups])
            advantages, keep = algo.advantages(rewards)
        by_group = {g: (advantages[j].tolist(), bool(keep[j])) for j, g in enumerate(groups)}
        train_samples, train_adv, seen = [], [], {g: 0 for g in groups}
        for s in samples:
            adv, kept = by_group[s.group]
            if kept:
                train_samples.append(s)
                train_adv.append(adv[seen[s.group]])
            seen[s.group] += 1

        metrics = {
            "step": float(self.step_count), "policy_version": float(self.version),
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "adv_mean": float(advantages.mean()), "adv_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
            "adv_abs_max": float(advantages.abs().max()),
            "staleness": float(self.version - batch.policy_version),
            "dropped_samples": float(self.rollouts.stats.dropped_samples - dropped_before),
            "dropped_samples_total": float(self.rollouts.stats.dropped_samples),
            "filtered_groups": float((~keep).sum()), "refills": float(refills),
            "gen_tokens_per_s": batch.generated_tokens / max(batch.seconds, 1e-9),
            "completion_len": sum(len(s.completion) for s in samples) / len(samples),
        }
        if train_samples:
            metrics |= self.train_on_batch(train_samples, train_adv)
        else:
            metrics |= {"loss": 0.0, "train_tokens_per_s": 0.0}
        self.version += 1
        self.generator.update_weights(self._weights_for_generator(), version=self.version)
        self.step_count += 1
        return metrics

    def _weights_for_generator(self) -> dict[str, torch.Tensor]:
        gen_model = getattr(self.generator, "model", None)
        if gen_model is self.policy:
            return {}  # shared model: nothing to copy, only the version moves
        if self.export_weights is not None:
            return self.export_weights()
        return {k: v.detach() for k, v in self.policy.state_dict().items()}

    def train_on_batch(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        """The optimisation half of a step (reusable by a distributed trainer with its own rollouts)."""
        cfg, loss_cfg = self.config, self.config.algorithm.loss
        start = time.perf_counter()
        batch = TrainBatch.from_samples(samples, advantages, pad_id=self.pad_id, device=self.device)
        temperature = self.sampling.temperature if self.sampling.temperature > 0 else 1.0
        with torch.no_grad():
            old = token_logprobs(self.policy, batch.tokens, temperature=temperature) if cfg.minibatches > 1 else None
            ref = (token_logprobs(self.reference, batch.tokens, temperature=temperature)
                   if self.reference is not None else None)
        n = len(samples)
        order = torch.arange(n)
        sums: dict[str, float] = {}
        mismatch_max, mismatch_sum, mismatch_count = 0.0, 0.0, 0.0
        for part in order.chunk(cfg.minibatches):
            logp, entropy = token_logprobs_and_entropy(self.policy, batch.tokens[part], temperature=temperature)
            mask = batch.mask[part]
            old_part = old[part] if old is not None else logp.detach()
            with torch.no_grad():
                diff = ((old_part - batch.behavior_logprobs[part]).abs() * mask)
                mismatch_max = max(mismatch_max, float(diff.max()))
                mismatch_sum += float(diff.sum())
                mismatch_count += float(mask.sum())
                sums["entropy"] = sums.get("entropy", 0.0) + float((entropy * mask).sum() / mask.sum().clamp_min(1))
            out = policy_loss(loss_cfg, logprobs=logp, advantages=batch.advantages[part], mask=mask,
                              old_logprobs=old_part, behavior_logprobs=batch.behavior_logprobs[part],
                              ref_logprobs=None if ref is None else ref[part])
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            if cfg.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm)
            self.optimizer.step()
            sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach())
            for k, v in out.metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        metrics = {k: v / cfg.minibatches for k, v in sums.items()}
        seconds = time.perf_counter() - start
        metrics["logprob_mismatch_max"] = mismatch_max
        metrics["logprob_mismatch_mean"] = mismatch_sum / max(mismatch_count, 1.0)
        metrics["train_tokens_per_s"] = float(batch.tokens.numel()) / max(seconds, 1e-9)
        metrics["trained_samples"] = float(n)
        metrics.setdefault("kl", 0.0)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        return metrics
