"""Verifiable-reward tasks and the tool-calling environment."""
from __future__ import annotations

import random

import pytest

from titan_rl.envs import ArithmeticTask, CountdownTask, SingleTurn, SortingTask, StepResult, ToolEnv, calculator
from titan_rl.envs.countdown import evaluate


def test_arithmetic_rewards_only_the_exact_answer():
    env = SingleTurn(ArithmeticTask(max_operand=20))
    prompt = env.reset(seed=3)
    expected = str(eval(prompt[:-1]))  # the prompt is our own trusted text
    assert env.step(expected + "\nrest is ignored").reward == 1.0
    env.reset(seed=3)
    assert env.step(str(int(expected) + 1)).reward == 0.0
    assert env.reset(seed=3) == prompt  # deterministic per seed


def test_sorting_partial_credit():
    task = SortingTask(min_length=4, max_length=4)
    for seed in range(20):
        p = task.sample(random.Random(seed))
        digits = p.prompt[len("sort:"):-1]
        assert p.answer == "".join(sorted(digits))
        assert task.reward(p, p.answer) == 1.0
    p = task.sample(random.Random(0))
    wrong_last = p.answer[:3] + ("0" if p.answer[3] != "0" else "1")
    assert task.reward(p, wrong_last) == 0.75
    assert task.reward(p, p.answer + "99") == pytest.approx(4 / 6)  # extra characters cost
    assert task.reward(p, "") == 0.0


def test_countdown_accepts_any_valid_solution_and_rejects_reuse():
    task = CountdownTask(num_numbers=4, max_number=12)
    for seed in range(30):
        p = task.sample(random.Random(seed))
        assert task.reward(p, p.answer) == 1.0, p
    from titan_rl.envs.base import Problem
    p = Problem(prompt="countdown:2 3 5 7>17=", answer="((2*5)+7)")
    assert task.reward(p, "7+5*2") == 1.0            # another valid expression
    assert task.reward(p, "3*5+2") == 1.0            # a subset of the numbers is allowed
    assert task.reward(p, "7+7+3") == pytest.approx(0.1)  # 7 used twice
    assert task.reward(p, "2+3") == pytest.approx(0.1)    # well-formed, wrong value
    assert task.reward(p, "__import__('os')") == 0.0  # never evaluated as code
    assert evaluate("1/0") is None and evaluate("2**10") is None


def test_tool_env_multi_turn_episode():
    env = ToolEnv(ArithmeticTask(max_operand=50, ops="*"), max_turns=3)
    prompt = env.reset(seed=1)
    assert "calc" in prompt
    question = prompt.splitlines()[-1]
    out = env.step(f"let me compute <tool>calc: {question[:-1]}</tool>")
    assert isinstance(out, StepResult) and not out.done and out.reward == 0.0
    value = out.observation.removeprefix("<result>").removesuffix("</result>")
    assert value == str(eval(question[:-1]))
    final = env.step(f"<answer>{value}</answer>")
    assert final.done and final.reward == 1.0 and final.info["turns"] == 2
    assert env.calls == [("calc", f" {question[:-1]}", value)]


def test_tool_env_errors_and_turn_limit():
    env = ToolEnv(ArithmeticTask(), max_turns=2)
    env.reset(seed=0)
    out = env.step("<tool>shell: rm -rf /</tool>")
    assert "unknown tool 'shell'" in out.observation and not out.done
    last = env.step("no answer here")
    assert last.done and last.reward == 0.0 and last.info["truncated"]
    assert calculator("6/4") == "3/2" and calculator("import os").startswith("error")
    with pytest.raises(ValueError, match="reset"):
        ToolEnv(ArithmeticTask()).step("x")
