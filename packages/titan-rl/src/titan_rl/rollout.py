"""Rollouts: episodes from environments, generated in groups, tagged with the policy version.

`collect_rollouts` runs one batch of episodes (single- or multi-turn) through a generator.
`AsyncRollouts` runs it in a background thread while the trainer trains, keeping at most
`max_policy_lag` versions of staleness: a batch produced by policy version v is usable at trainer
version t only if t - v <= max_policy_lag; older ones are dropped and counted.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from titan_rl.envs.base import Environment
from titan_rl.generation.base import Generator
from titan_rl.generation.sampling import SamplingConfig
from titan_rl.tokenizer import Tokenizer


@dataclass(kw_only=True)
class Sample:
    """One episode. `completion` holds everything after the prompt: the model's tokens (loss_mask 1,
    with the generator's logprobs) and, in multi-turn episodes, the environment's observations
    (loss_mask 0, logprob 0)."""

    prompt: list[int]
    completion: list[int]
    loss_mask: list[int]
    behavior_logprobs: torch.Tensor  # [len(completion)] float32
    reward: float
    group: int                       # samples of one prompt share a group id
    policy_version: int              # the oldest weights version that produced any of its tokens
    turns: int = 1
    text: str = ""

    def __post_init__(self) -> None:
        assert len(self.completion) == len(self.loss_mask) == len(self.behavior_logprobs)


@dataclass(kw_only=True)
class RolloutBatch:
    samples: list[Sample]
    generated_tokens: int
    seconds: float

    @property
    def policy_version(self) -> int:
        return min(s.policy_version for s in self.samples)


def collect_rollouts(*, make_env: Callable[[], Environment], seeds: list[int], group_size: int,
                     generator: Generator, tokenizer: Tokenizer, sampling: SamplingConfig,
                     max_turns: int = 1, first_group: int = 0) -> RolloutBatch:
    """Runs len(seeds) * group_size episodes: `group_size` samples of each seed's problem.

    Each turn generates for every unfinished episode at once; an episode's next prompt is its prompt
    plus everything so far (no prefix caching)."""
    start = time.perf_counter()
    envs, prompts, groups = [], [], []
    for g, seed in enumerate(seeds):
        for _ in range(group_size):
            env = make_env()
            envs.append(env)
            prompts.append(tokenizer.encode(env.reset(seed=seed)))
            groups.append(first_group + g)
    n = len(envs)
    completion: list[list[int]] = [[] for _ in range(n)]
    mask: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    rewards, versions, turns, texts = [0.0] * n, [None] * n, [0] * n, [""] * n
    active = list(range(n))
    generated = 0
    for turn in range(max_turns):
        outs = generator.generate([prompts[i] + completion[i] for i in active], sampling)
        still = []
        for i, out in zip(active, outs):
            generated += len(out.tokens)
            completion[i] += out.tokens
            mask[i] += [1] * len(out.tokens)
            logps[i].append(out.logprobs)
            versions[i] = out.policy_version if versions[i] is None else min(versions[i], out.policy_version)
            turns[i] += 1
            text = tokenizer.decode([t for t in out.tokens if t != tokenizer.eos_id])
            texts[i] += text
            result = envs[i].step(text)
            if result.done or turn == max_turns - 1:
                rewards[i] = result.reward if result.done else 0.0
                continue
            obs = tokenizer.encode(result.observation)
            texts[i] += result.observation
            completion[i] += obs
            mask[i] += [0] * len(obs)
            logps[i].append(torch.zeros(len(obs)))
            still.append(i)
        active = still
        if not active:
            break
    samples = [
        Sample(prompt=prompts[i], completion=completion[i], loss_mask=mask[i], behavior_logprobs=torch.cat(logps[i]),
               reward=float(rewards[i]), group=groups[i], policy_version=versions[i], turns=turns[i], text=texts[i])
        for i in range(n)
    ]
    return RolloutBatch(samples=samples, generated_tokens=generated, seconds=time.perf_counter() - start)


@dataclass(kw_only=True)
class StalenessStats:
    dropped_samples: int = 0     # cumulative
    dropped_batches: int = 0
    lags: list[int] = field(default_factory=list)  # lag of each batch handed to the trainer


class AsyncRollouts:
    """Produces rollout batches in a background thread; `get(trainer_version)` returns the next batch
    whose lag is within `max_policy_lag`, dropping (and counting) older ones.

    `produce(first_group)` makes one batch with the generator's current weights. With
    max_policy_lag == 0 no thread is started: `get` produces on demand, always on-policy.
    The queue holds at most max(1, max_policy_lag) batches, so the producer cannot run far ahead.
    """

    def __init__(self, produce: Callable[[int], RolloutBatch], *, max_policy_lag: int, groups_per_batch: int) -> None:
        if max_policy_lag < 0:
            raise ValueError(f"max_policy_lag={max_policy_lag}; must be >= 0 (0 = synchronous, on-policy)")
        self.produce = produce
        self.max_policy_lag = max_policy_lag
        self.groups_per_batch = groups_per_batch
        self.stats = StalenessStats()
        self._next_group = 0
        self._queue: queue.Queue[RolloutBatch | BaseException] = queue.Queue(maxsize=max(1, max_policy_lag))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if max_policy_lag > 0:
            self._thread = threading.Thread(target=self._run, name="titan-rl-rollouts", daemon=True)
            self._thread.start()

    def _take_groups(self) -> int:
        first = self._next_group
        self._next_group += self.groups_per_batch
        return first

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.produce(self._take_groups())
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # surfaced to the trainer by get()
            self._queue.put(exc)

    def get(self, trainer_version: int, *, timeout: float = 600.0) -> RolloutBatch:
        if self._thread is None:
            batch = self.produce(self._take_groups())
            self.stats.lags.append(trainer_version - batch.policy_version)
            return batch
        while True:
            item = self._queue.get(timeout=timeout)
            if isinstance(item, BaseException):
                raise RuntimeError("the rollout thread failed") from item
            lag = trainer_version - item.policy_version
            if lag <= self.max_policy_lag:
                self.stats.lags.append(lag)
                return item
            self.stats.dropped_batches += 1
            self.stats.dropped_samples += len(item.samples)

    def queued(self) -> int:
        """Batches produced and waiting for the trainer (for monitoring)."""
        return self._queue.qsize()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def __enter__(self) -> "AsyncRollouts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
