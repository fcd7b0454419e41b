"""Write-the-function tasks: a small list or arithmetic function given by input/output examples, scored
by hidden tests in the sandbox. Generated procedurally (no download), with disjoint train and held-out splits.

A problem shows three examples, `f([3,1,2])=[1,2,3]` one per line; the hidden tests are four more
inputs of the same function, whose expected values are computed here and never enter the sandbox
(`code_reward`). The split is by problem: a problem belongs to the held-out split when a hash of its
text (examples and hidden tests) falls in the held-out fraction, so no held-out problem is ever drawn
for pretraining or RL, whatever the seed.

`demonstration(problem)` is a solved episode in the multi-turn protocol of `ToolEnv` (a `python` tool
call that runs the solution on the first example, its output, then the answer), the text the policy is
pretrained on; `code_exec_env(task)` makes that environment with the sandboxed python tool.
"""
from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from titan_rl.envs.base import Problem
from titan_rl.envs.code import code_reward
from titan_rl.envs.python_tool import PythonTool
from titan_rl.envs.sandbox import SandboxConfig
from titan_rl.envs.tools import ToolEnv

# (name, body of `def f(x):`, the reference). Inputs are lists of 2-4 digits; every function is defined on them.
FAMILIES: tuple[tuple[str, str, Callable[[list[int]], Any]], ...] = (
    ("sorted", "return sorted(x)", sorted),
    ("reverse", "return x[::-1]", lambda x: x[::-1]),
    ("sum", "return sum(x)", sum),
    ("max", "return max(x)", max),
    ("min", "return min(x)", min),
    ("len", "return len(x)", len),
    ("first", "return x[0]", lambda x: x[0]),
    ("last", "return x[-1]", lambda x: x[-1]),
    ("add1", "return [v+1 for v in x]", lambda x: [v + 1 for v in x]),
    ("add2", "return [v+2 for v in x]", lambda x: [v + 2 for v in x]),
    ("double", "return [v*2 for v in x]", lambda x: [v * 2 for v in x]),
    ("evens", "return [v for v in x if v%2==0]", lambda x: [v for v in x if v % 2 == 0]),
)
FAMILY_NAMES = tuple(name for name, _, _ in FAMILIES)
EXAMPLES, HIDDEN_TESTS = 3, 4


def _show(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))  # [1,2,3]: the compact form the prompt uses


@dataclass(kw_only=True, frozen=True)
class FunctionProblem(Problem):
    family: str
    solution: str                               # the reference program, `def f(x):...`
    checks: tuple[tuple[str, Any], ...]         # hidden tests: (expression, expected value)
    first_input: list[int] = field(default_factory=list)


@dataclass(kw_only=True, frozen=True)
class FunctionTask:
    """Problems of `families` (default: all of FAMILIES) from `split`; reward = fraction of the hidden tests passed."""

    split: Literal["train", "heldout"] = "train"
    heldout_fraction: float = 0.2
    families: tuple[str, ...] = FAMILY_NAMES
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        if self.split not in ("train", "heldout"):
            raise ValueError(f"split={self.split!r}; allowed: 'train', 'heldout'")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}; must be in (0, 1)")
        unknown = sorted(set(self.families) - set(FAMILY_NAMES))
        if unknown or not self.families:
            raise ValueError(f"families={self.families!r}: unknown {unknown}; allowed: {', '.join(FAMILY_NAMES)}")

    def in_heldout(self, text: str) -> bool:
        return zlib.crc32(text.encode()) % 10_000 < self.heldout_fraction * 10_000

    def sample(self, rng: random.Random) -> FunctionProblem:
        """A problem of this split (redrawn from `rng` until it is: the splits never share a problem)."""
        while True:
            problem = self._draw(rng)
            if self.in_heldout(problem.prompt + repr(problem.checks)) == (self.split == "heldout"):
                return problem

    def _draw(self, rng: random.Random) -> FunctionProblem:
        name = rng.choice(self.families)
        _, body, fn = FAMILIES[FAMILY_NAMES.index(name)]
        inputs: list[list[int]] = []
        while len(inputs) < EXAMPLES + HIDDEN_TESTS:
            x = [rng.randint(0, 9) for _ in range(rng.randint(2, 4))]
            if x not in inputs:
                inputs.append(x)
        shown, hidden = inputs[:EXAMPLES], inputs[EXAMPLES:]
        prompt = "".join(f"f({_show(x)})={_show(fn(x))}\n" for x in shown)
        solution = f"def f(x):{body}"
        checks = tuple((f"f({_show(x)})", fn(x)) for x in hidden)
        return FunctionProblem(prompt=prompt, answer=solution, family=name, solution=solution, checks=checks,
                               first_input=shown[0])

    def reward(self, problem: Problem, completion: str) -> float:
        if not isinstance(problem, FunctionProblem):
            raise TypeError(f"FunctionTask scores its own problems (FunctionProblem), got {type(problem).__name__}")
        return code_reward(completion.strip(), list(problem.checks), config=self.sandbox)[0]

    def demonstration(self, problem: FunctionProblem) -> str:
        """A solved episode after ToolEnv's prompt: run the solution on the first example, then answer.
        The tool's output is what `print` writes for the reference value (the sandbox prints the same)."""
        call = f"{problem.solution}\nprint(f({_show(problem.first_input)}))"
        output = repr(FAMILIES[FAMILY_NAMES.index(problem.family)][2](problem.first_input)) + "\n"
        return f"<tool>python: {call}</tool><result>{output}</result><answer>{problem.solution}</answer>"


def code_exec_env(task: FunctionTask, *, max_turns: int = 3) -> ToolEnv:
    """The multi-turn code-execution episode: `<tool>python: CODE</tool>` runs CODE in the sandbox and
    its output comes back as `<result>...</result>`; `<answer>PROGRAM</answer>` is scored by the hidden tests."""
    return ToolEnv(task, tools={"python": PythonTool(config=task.sandbox)}, max_turns=max_turns)
