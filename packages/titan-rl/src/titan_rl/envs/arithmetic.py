"""Arithmetic: `a+b=` (or -, *) with the exact integer answer."""
from __future__ import annotations

import random
from dataclasses import dataclass

from titan_rl.envs.base import Problem, first_line


@dataclass(kw_only=True, frozen=True)
class ArithmeticTask:
    """Problems `a<op>b=` with operands in [0, max_operand]; reward 1.0 for the exact answer, else 0.0."""

    max_operand: int = 99
    ops: str = "+-*"

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand={self.max_operand}; must be >= 1")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops={self.ops!r}; allowed characters: '+', '-', '*'")

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"{a}{op}{b}=", answer=str(value))

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if first_line(completion) == problem.answer else 0.0
