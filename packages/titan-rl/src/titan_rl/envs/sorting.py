"""Sorting: `sort:3142=` -> `1234`, with partial credit per position (a dense learning signal)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from titan_rl.envs.base import Problem, first_line


@dataclass(kw_only=True, frozen=True)
class SortingTask:
    """Sort `length` digits ascending. Reward: fraction of the answer's positions that are right
    (a longer or shorter answer only loses the positions it gets wrong or misses)."""

    min_length: int = 3
    max_length: int = 6

    def __post_init__(self) -> None:
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"need 1 <= min_length <= max_length; got {self.min_length}, {self.max_length}")

    def sample(self, rng: random.Random) -> Problem:
        digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(self.min_length, self.max_length))]
        return Problem(prompt=f"sort:{''.join(digits)}=", answer="".join(sorted(digits)))

    def reward(self, problem: Problem, completion: str) -> float:
        got, want = first_line(completion), problem.answer
        right = sum(1 for a, b in zip(got, want) if a == b)
        return right / max(len(want), len(got))
