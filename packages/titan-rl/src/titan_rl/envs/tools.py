"""Multi-turn episodes with tool calls.

Protocol (plain text, so any tokenizer works): the model calls a tool with
`<tool>NAME: ARGUMENT</tool>`; the environment answers `<result>...</result>` and the model goes on.
`<answer>...</answer>` ends the episode and is scored by the task. An episode that reaches
`max_turns` without an answer ends with reward 0.
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable

from titan_rl.envs.base import Problem, StepResult, Task
from titan_rl.envs.countdown import evaluate

_TOOL = re.compile(r"<tool>\s*([A-Za-z_][\w-]*)\s*:(.*?)</tool>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

# Tool completions end at these strings, so a generator can stop exactly where the env must answer.
STOP_STRINGS = ("</tool>", "</answer>")


def calculator(expression: str) -> str:
    """+ - * / over integers, exact; evaluated with the countdown parser (no code execution)."""
    value = evaluate(expression.strip())
    if value is None:
        return "error: not an arithmetic expression"
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


class ToolEnv:
    """A Task played over several turns, with tools the model may call before it answers."""

    def __init__(self, task: Task, *, tools: dict[str, Callable[[str], str]] | None = None, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}; must be >= 1")
        self.task = task
        self.tools = {"calc": calculator} if tools is None else dict(tools)
        self.max_turns = max_turns
        self.problem: Problem | None = None
        self.turns = 0
        self.calls: list[tuple[str, str, str]] = []

    def reset(self, *, seed: int) -> str:
        self.problem = self.task.sample(random.Random(seed))
        self.turns = 0
        self.calls = []
        names = ", ".join(sorted(self.tools))
        return f"Tools: {names}. Call <tool>NAME: ARG</tool>, finish with <answer>...</answer>.\n{self.problem.prompt}"

    def step(self, action: str) -> StepResult:
        if self.problem is None:
            raise ValueError("step() before reset(): call reset(seed=...) first")
        self.turns += 1
        answer = _ANSWER.search(action)
        call = _TOOL.search(action)
        # Whichever comes first in the text wins: a model that calls a tool then answers answered.
        if answer and (call is None or answer.start() < call.start()):
            reward = self.task.reward(self.problem, answer.group(1))
            return StepResult(observation="", reward=reward, done=True, info={"turns": self.turns, "calls": self.calls})
        if self.turns >= self.max_turns:
            return StepResult(observation="", reward=0.0, done=True, info={"turns": self.turns, "calls": self.calls, "truncated": True})
        if call is None:
            observation = "<result>error: no tool call or answer found</result>"
        else:
            name, arg = call.group(1), call.group(2)
            tool = self.tools.get(name)
            out = f"error: unknown tool {name!r}" if tool is None else tool(arg)
            self.calls.append((name, arg, out))
            observation = f"<result>{out}</result>"
        return StepResult(observation=observation, reward=0.0, done=False, info={"turns": self.turns})
