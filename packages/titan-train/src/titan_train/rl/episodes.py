"""What an RL job's episodes are, per task: the training and held-out environments, the turns and stop
strings of an episode, and the supervised text pretraining teaches the format with.

Single-turn tasks (sorting, arithmetic, countdown) play one step; held-out problems are the same task's
problems from seeds training never uses, and a demonstration is prompt + reference answer. The code task
is a multi-turn tool episode (`titan_rl.envs.code_exec_env`): the policy may run Python in the sandbox
and see its output before it answers; held-out problems come from the task's held-out split, and a
demonstration is a solved episode (tool call, its output, the answer).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from titan_rl.envs import STOP_STRINGS, Environment, SingleTurn, Task
from titan_rl.envs.function_tasks import FunctionTask, code_exec_env

from .build import make_task
from .config import EnvConfig


@dataclass(kw_only=True, frozen=True)
class Episodes:
    make_env: Callable[[], Environment]
    """A fresh training environment (reset with a training seed)."""
    make_eval_env: Callable[[], Environment]
    """A fresh environment of held-out problems (reset with an evaluation seed)."""
    max_turns: int
    stop_strings: tuple[str, ...]
    """Strings that end a turn, so that the environment answers right after them."""
    demonstration: Callable[[random.Random], str]
    """One supervised pretraining document (a solved episode) from `rng`."""


def make_episodes(env: EnvConfig) -> Episodes:
    task = make_task(env)
    if isinstance(task, FunctionTask):
        heldout = FunctionTask(split="heldout", heldout_fraction=task.heldout_fraction, families=task.families,
                               sandbox=task.sandbox)
        return Episodes(make_env=lambda: code_exec_env(task, max_turns=env.max_turns),
                        make_eval_env=lambda: code_exec_env(heldout, max_turns=env.max_turns),
                        max_turns=env.max_turns, stop_strings=STOP_STRINGS,
                        demonstration=lambda rng: _solved_episode(task, rng))
    return Episodes(make_env=lambda: SingleTurn(task), make_eval_env=lambda: SingleTurn(task), max_turns=1,
                    stop_strings=(), demonstration=lambda rng: _prompt_and_answer(task, rng))


def _prompt_and_answer(task: Task, rng: random.Random) -> str:
    problem = task.sample(rng)
    return problem.prompt + problem.answer


def _solved_episode(task: FunctionTask, rng: random.Random) -> str:
    env = code_exec_env(task)
    prompt = env.reset(seed=rng.getrandbits(62))  # the environment's own prompt (its tool line included)
    return prompt + task.demonstration(env.problem)
