"""Code-execution reward: the completion is a Python program, scored by running tests in the sandbox."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from titan_rl.envs.base import Problem
from titan_rl.envs.sandbox import SandboxConfig, SandboxResult, run_sandboxed

# The harness appended after the candidate: each assert that holds counts one point. The count is
# printed behind a per-run nonce so that a program printing its own "PASSED" line cannot forge it.
_HARNESS = """
import sys as _sys
_passed = 0
for _check in {checks!r}:
    try:
        _ok = eval(_check)
    except BaseException:
        _ok = False
    _passed += bool(_ok)
_sys.stdout.write("\\n{nonce} %d\\n" % _passed)
"""


def code_reward(program: str, checks: list[str], *, config: SandboxConfig | None = None,
                rng: random.Random | None = None) -> tuple[float, SandboxResult]:
    """Fraction of `checks` (Python expressions) that evaluate truthy after running `program`; 0.0 if the
    program fails, exceeds a limit, or attempts an escape (the result says which)."""
    if not checks:
        raise ValueError("checks is empty; give at least one expression to evaluate")
    nonce = f"TITAN-{(rng or random.SystemRandom()).getrandbits(64):016x}"
    result = run_sandboxed(program + "\n" + _HARNESS.format(checks=list(checks), nonce=nonce), config or SandboxConfig())
    if result.status != "ok":
        return 0.0, result
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce + " "):
            return int(line.split()[1]) / len(checks), result
    return 0.0, result


@dataclass(kw_only=True, frozen=True)
class CodeTask:
    """Write-a-function problems; reward = fraction of hidden checks passed in the sandbox."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    _PROBLEMS = (
        ("Write a Python function add(a, b) returning a + b.", "def add(a, b):\n    return a + b",
         ["add(1, 2) == 3", "add(-5, 5) == 0", "add(10**6, 1) == 1000001"]),
        ("Write a Python function rev(s) returning the string s reversed.", "def rev(s):\n    return s[::-1]",
         ["rev('abc') == 'cba'", "rev('') == ''", "rev('ab ') == ' ba'"]),
        ("Write a Python function evens(xs) returning the even numbers of xs in order.",
         "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
         ["evens([1, 2, 3, 4]) == [2, 4]", "evens([]) == []", "evens([7]) == []"]),
    )

    def sample(self, rng: random.Random) -> Problem:
        prompt, solution, _ = rng.choice(self._PROBLEMS)
        return Problem(prompt=prompt + "\n", answer=solution)

    def reward(self, problem: Problem, completion: str) -> float:
        checks = next(c for p, _, c in self._PROBLEMS if p + "\n" == problem.prompt)
        return code_reward(completion, checks, config=self.sandbox)[0]
