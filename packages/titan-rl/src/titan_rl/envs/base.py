"""The environment interface: `reset` gives the prompt, `step` takes the model's text and answers.

A single-turn task is an environment whose first `step` ends the episode with the reward. A
multi-turn environment (tool calls) answers with an observation that the generator appends to the
conversation before sampling the next turn.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(kw_only=True)
class StepResult:
    observation: str  # text to append before the model's next turn ("" when done)
    reward: float     # the episode's reward when done (0.0 on intermediate turns)
    done: bool
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, *, seed: int) -> str: ...
    def step(self, action: str) -> StepResult: ...


@dataclass(kw_only=True, frozen=True)
class Problem:
    prompt: str
    answer: str  # a reference answer (countdown accepts others: the reward checks validity)


class Task(Protocol):
    """A verifiable single-turn task: problems from a seed, and a reward for a completion."""

    def sample(self, rng: random.Random) -> Problem: ...
    def reward(self, problem: Problem, completion: str) -> float: ...


class SingleTurn:
    """Adapts a Task to the Environment interface (one step per episode)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.problem: Problem | None = None

    def reset(self, *, seed: int) -> str:
        self.problem = self.task.sample(random.Random(seed))
        return self.problem.prompt

    def step(self, action: str) -> StepResult:
        if self.problem is None:
            raise ValueError("step() before reset(): call reset(seed=...) first")
        reward = self.task.reward(self.problem, action)
        return StepResult(observation="", reward=reward, done=True, info={"answer": self.problem.answer})


def first_line(completion: str) -> str:
    """The answer part of a completion: text before the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()
