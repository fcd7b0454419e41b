"""Rollouts over the ranks: each rank generates an equal share of every batch's prompt groups with its
own generator, then all ranks agree on one global batch (the same samples, in group order, everywhere).

A batch's groups are numbered globally (batch k holds groups k*G .. k*G+G-1) and group g's problem is
built from the seed `job.seed * 1_000_003 + g`, so the problems a step sees do not depend on the number
of ranks. With max_policy_lag > 0 every rank runs titan-rl's AsyncRollouts (background generation,
stale batches dropped); ranks may then drop different batches, so before a step they compare which
batch they hold, and those behind skip forward (counted as dropped) until all hold the same one.

Disaggregated (generator.ranks > 0): generator j of G makes share j of each batch (`rollout_share`, the same
problems as above) on its own rank, and the trainer ranks get the batches through titan_rl.RemoteRollouts
(`DisaggregatedRollouts`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titan_rl import (
    AsyncRollouts,
    Generator,
    RemoteRollouts,
    RolloutBatch,
    Sample,
    SamplingConfig,
    Tokenizer,
    collect_rollouts,
    full_tensors,
)
from titan_rl.envs import Environment

from .policy import export_weights

SEED_STRIDE = 1_000_003            # as titan_rl.RLLoop: seed * stride + group index
EVAL_SEED_BASE = 10**12            # evaluation problems come from seeds far past any training group


@dataclass(kw_only=True)
class GlobalBatch:
    samples: list[Sample]          # every rank's samples, in group order (identical on all ranks)
    policy_version: int            # the oldest weights version that produced any of them
    generated_tokens: int          # over all ranks
    generation_seconds: float      # the slowest rank's
    dropped_samples: int           # dropped since the previous batch, over all ranks (stale or skipped)


def _rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather(value, group: dist.ProcessGroup | None = None):
    rank, world = _rank_world(group)
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def rollout_share(*, batch_index: int, rank: int, world: int, make_env: Callable[[], Environment],
                  generator: Generator, tokenizer: Tokenizer, sampling: SamplingConfig, group_size: int,
                  groups_per_step: int, seed: int, max_turns: int = 1) -> RolloutBatch:
    """Generator `rank` of `world`'s share of batch `batch_index` (its groups, numbered globally)."""
    share = groups_per_step // world
    mine = batch_index * groups_per_step + rank * share
    seeds = [seed * SEED_STRIDE + g for g in range(mine, mine + share)]
    return collect_rollouts(make_env=make_env, seeds=seeds, group_size=group_size, generator=generator,
                            tokenizer=tokenizer, sampling=sampling, max_turns=max_turns, first_group=mine)


class ShardedRollouts:
    def __init__(self, *, make_env: Callable[[], Environment], generator: Generator, tokenizer: Tokenizer,
                 sampling: SamplingConfig, group_size: int, groups_per_step: int, max_policy_lag: int,
                 seed: int, max_turns: int = 1) -> None:
        self.rank, self.world = _rank_world()
        assert groups_per_step % self.world == 0, "validate() checks rollout.prompts_per_step against the world size"
        self.share = groups_per_step // self.world
        self.groups_per_step = groups_per_step
        self.make_env, self.generator, self.tokenizer = make_env, generator, tokenizer
        self.sampling, self.group_size, self.seed, self.max_turns = sampling, group_size, seed, max_turns
        self._skipped = 0
        self._dropped_seen = 0
        self.local = AsyncRollouts(self._produce, max_policy_lag=max_policy_lag, groups_per_batch=groups_per_step)

    def _produce(self, first_group: int) -> RolloutBatch:
        """This rank's share of the batch whose groups start at `first_group` (a global group number)."""
        return rollout_share(batch_index=first_group // self.groups_per_step, rank=self.rank, world=self.world,
                             make_env=self.make_env, generator=self.generator, tokenizer=self.tokenizer,
                             sampling=self.sampling, group_size=self.group_size,
                             groups_per_step=self.groups_per_step, seed=self.seed, max_turns=self.max_turns)

    def _batch_index(self, batch: RolloutBatch) -> int:
        return min(s.group for s in batch.samples) // self.groups_per_step

    def get(self, trainer_version: int) -> GlobalBatch:
        """The next batch within the staleness bound on every rank, gathered (a collective: all ranks call it)."""
        local = self.local.get(trainer_version)
        while True:
            indices = _all_gather(self._batch_index(local))
            target = max(indices)
            if min(indices) == target:
                break
            if self._batch_index(local) < target:  # other ranks dropped this batch as stale: skip it too
                self._skipped += len(local.samples)
                local = self.local.get(trainer_version)
        dropped = self.local.stats.dropped_samples + self._skipped
        parts = _all_gather((local, dropped - self._dropped_seen))
        self._dropped_seen = dropped
        # A group's samples all come from one rank; sorted() is stable, so they keep their order.
        samples = sorted((s for part, _ in parts for s in part.samples), key=lambda s: s.group)
        return GlobalBatch(samples=samples, policy_version=min(part.policy_version for part, _ in parts),
                           generated_tokens=sum(part.generated_tokens for part, _ in parts),
                           generation_seconds=max(part.seconds for part, _ in parts),
                           dropped_samples=sum(d for _, d in parts))

    def publish(self, policy: nn.Module, version: int) -> None:
        """Hand each rank's generator the policy's full weights (a collective over the policy's ranks)."""
        self.generator.update_weights(export_weights(policy), version=version)

    def close(self) -> None:
        self.local.close()


class DisaggregatedRollouts:
    """The trainer ranks' rollouts under disaggregated generation (titan_rl.RemoteRollouts): batches come
    from the generator ranks, the weights go back to them (`publish`, every trainer rank) in their dtype."""

    def __init__(self, remote: RemoteRollouts) -> None:
        self.remote = remote
        self._version = 0

    def get(self, trainer_version: int) -> GlobalBatch:
        batch = self.remote.get(trainer_version)
        samples = sorted((s for part in batch.parts for s in part.samples), key=lambda s: s.group)
        return GlobalBatch(samples=samples, policy_version=batch.policy_version,
                           generated_tokens=sum(part.generated_tokens for part in batch.parts),
                           generation_seconds=max(part.seconds for part in batch.parts),
                           dropped_samples=batch.dropped_samples)

    def publish(self, policy: nn.Module, version: int) -> None:
        self.remote.publish(full_tensors(policy), version=version)
        self._version = version

    def close(self) -> None:
        self.remote.close(version=self._version)


@torch.no_grad()
def greedy_eval(*, make_env: Callable[[], Environment], generator: Generator, tokenizer: Tokenizer, problems: int,
                sampling: SamplingConfig, seed: int, max_turns: int = 1, group: dist.ProcessGroup | None = None
                ) -> float:
    """Mean reward of greedy episodes (`sampling` at temperature 0) on `problems` held-out problems, split
    over the ranks of `group` (a collective of them; None: all ranks). Multi-turn episodes get their tool
    answers as in training."""
    rank, world = _rank_world(group)
    indices = torch.arange(problems).tensor_split(world)[rank].tolist()
    total = 0.0
    if indices:
        greedy = dataclasses.replace(sampling, temperature=0.0, seed=None)
        seeds = [EVAL_SEED_BASE + seed * SEED_STRIDE + i for i in indices]
        batch = collect_rollouts(make_env=make_env, seeds=seeds, group_size=1, generator=generator,
                                 tokenizer=tokenizer, sampling=greedy, max_turns=max_turns)
        total = sum(s.reward for s in batch.samples)
    return sum(_all_gather(total, group)) / max(problems, 1)
