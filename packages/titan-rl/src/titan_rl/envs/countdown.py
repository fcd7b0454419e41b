"""Countdown: reach a target with + - * / over given numbers, each used at most once.

The reward checks any valid expression (not just the reference), parsing it with `ast` and
evaluating only integer literals and the four operators, so a completion can never run code.
"""
from __future__ import annotations

import ast
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from titan_rl.envs.base import Problem, first_line


@dataclass(kw_only=True, frozen=True)
class CountdownTask:
    """`countdown:3 7 25 50>175=`; reward 1.0 for an expression using a sub-multiset of the numbers
    that evaluates exactly to the target, 0.1 for a well-formed expression that misses, else 0.0."""

    num_numbers: int = 4
    max_number: int = 25

    def __post_init__(self) -> None:
        if not 2 <= self.num_numbers <= 6:
            raise ValueError(f"num_numbers={self.num_numbers}; allowed 2..6")
        if self.max_number < 2:
            raise ValueError(f"max_number={self.max_number}; must be >= 2")

    def sample(self, rng: random.Random) -> Problem:
        # Build a random expression over the numbers, so that a solution is known to exist.
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            terms = [str(n) for n in numbers]
            rng.shuffle(terms)
            expr = terms[0]
            for term in terms[1:]:
                expr = f"({expr}{rng.choice('+-*')}{term})"
            value = evaluate(expr)
            if value is not None and value.denominator == 1 and 0 < value <= 10_000:
                break
        shown = " ".join(str(n) for n in sorted(numbers))
        return Problem(prompt=f"countdown:{shown}>{int(value)}=", answer=expr)

    def reward(self, problem: Problem, completion: str) -> float:
        numbers_text, target_text = problem.prompt[len("countdown:"):-1].split(">")
        expr = first_line(completion)
        value = evaluate(expr)
        if value is None:
            return 0.0
        used = Counter(_literals(expr))
        allowed = Counter(int(n) for n in numbers_text.split())
        if any(used[n] > allowed[n] for n in used):
            return 0.1
        return 1.0 if value == int(target_text) else 0.1


def evaluate(expr: str) -> Fraction | None:
    """Exact value of an arithmetic expression over non-negative integer literals; None if malformed."""
    if len(expr) > 200:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    try:
        return _eval(tree.body)
    except (ValueError, ZeroDivisionError):
        return None


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        return a / b  # ZeroDivisionError is caught by evaluate()
    raise ValueError("not an arithmetic expression")


def _literals(expr: str) -> list[int]:
    return [n.value for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Constant)]
