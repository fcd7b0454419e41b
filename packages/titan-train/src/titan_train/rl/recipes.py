"""RL recipes: functions returning an RLConfig, registered for `titan-train rl --recipe NAME`
(`--recipe package.module:function` loads a user's own)."""
from __future__ import annotations

from collections.abc import Callable

from ..recipes import register_recipe
from .config import (
    GeneratorConfig,
    RLAlgorithmConfig,
    RLConfig,
    RLJobConfig,
    RolloutConfig,
)

RL_RECIPES: dict[str, Callable[[], RLConfig]] = {}
DEFAULT_RL_RECIPE = "rl_sorting"


@register_recipe("rl_sorting", registry=RL_RECIPES)
def rl_sorting() -> RLConfig:
    """The main RL job: a 2-layer debug Llama pretrained briefly on sorting 3 digits, then GRPO, on a CPU."""
    return RLConfig()


@register_recipe("rl_sorting_async", registry=RL_RECIPES)
def rl_sorting_async() -> RLConfig:
    """DAPO on sorting with rollouts generated one policy version ahead, batch-invariant trainer and generator."""
    return RLConfig(
        job=RLJobConfig(folder="runs/rl_sorting_async"),
        algorithm=RLAlgorithmConfig(name="dapo"),
        rollout=RolloutConfig(max_policy_lag=1),
        generator=GeneratorConfig(batch_invariant=True),
    )
