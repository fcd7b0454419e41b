"""`titan-train rl`: RL post-training of a titan-models policy with titan-rl, wired to titan-train's
pretraining, parallelism (FSDP over the ranks) and command line."""
from titan_train.rl.config import (
    EnvConfig,
    EvalConfig,
    GeneratorConfig,
    PolicyConfig,
    PretrainConfig,
    RLAlgorithmConfig,
    RLConfig,
    RLJobConfig,
    RLMetricsConfig,
    RLStepConfig,
    RolloutConfig,
)
from titan_train.rl.job import RLResult, run_rl
from titan_train.rl.recipes import RL_RECIPES
from titan_train.rl.update import PolicyUpdate

__all__ = [
    "EnvConfig", "EvalConfig", "GeneratorConfig", "PolicyConfig", "PolicyUpdate", "PretrainConfig",
    "RLAlgorithmConfig", "RLConfig", "RLMetricsConfig", "RLResult", "RLJobConfig", "RLStepConfig", "RL_RECIPES",
    "RolloutConfig", "run_rl",
]
