"""Rollouts over the ranks: each rank generates an equal share of every batch's prompt groups with its
own generator, then all ranks agree on one global batch (the same samples, in group order, everywhere).

A batch's groups are numbered globally (batch k holds groups k*G .. k*G+G-1) and group g's problem is
built from the seed `job.seed * 1_000_003 + g`, so the problems a step sees do not depend on the number
of ranks. With max_policy_lag > 0 every rank runs titan-rl's AsyncRollouts (background generation,
stale batches dropped); ranks may then drop different batches, so before a step they compare which
batch they hold, and those behind skip forward (counted as dropped) until all hold the same one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_rl import AsyncRollouts, Generator, RolloutBatch, Sample, SamplingConfig, Tokenizer, collect_rollouts
from titan_rl.envs import Environment

SEED_STRIDE = 1_000_003            # as titan_rl.RLLoop: seed * stride + group index
EVAL_SEED_BASE = 10**12            # evaluation problems come from seeds far past any training group


@dataclass(kw_only=True)
class GlobalBatch:
    samples: list[Sample]          # every rank's samples, in group order (identical on all ranks)
    policy_version: int            # the oldest weights version that produced any of them
    generated_tokens: int          # over all ranks
    generation_seconds: float      # the slowest rank's
    dropped_samples: int           # dropped since the previous batch, over all ranks (stale or skipped)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(value):
    rank, world = _rank_world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


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
        mine = first_group + self.rank * self.share
        seeds = [self.seed * SEED_STRIDE + g for g in range(mine, mine + self.share)]
        return collect_rollouts(make_env=self.make_env, seeds=seeds, group_size=self.group_size,
                                generator=self.generator, tokenizer=self.tokenizer, sampling=self.sampling,
                                max_turns=self.max_turns, first_group=mine)

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

    def close(self) -> None:
        self.local.close()


@torch.no_grad()
def greedy_eval(*, make_env: Callable[[], Environment], generator: Generator, tokenizer: Tokenizer, problems: int,
                sampling: SamplingConfig, seed: int, max_turns: int = 1) -> float:
    """Mean reward of greedy episodes (`sampling` at temperature 0) on `problems` held-out problems, split
    over the ranks (a collective). Multi-turn episodes get their tool answers as in training."""
    rank, world = _rank_world()
    indices = torch.arange(problems).tensor_split(world)[rank].tolist()
    total = 0.0
    if indices:
        greedy = dataclasses.replace(sampling, temperature=0.0, seed=None)
        seeds = [EVAL_SEED_BASE + seed * SEED_STRIDE + i for i in indices]
        batch = collect_rollouts(make_env=make_env, seeds=seeds, group_size=1, generator=generator,
                                 tokenizer=tokenizer, sampling=greedy, max_turns=max_turns)
        total = sum(s.reward for s in batch.samples)
    return sum(_all_gather(total)) / max(problems, 1)
