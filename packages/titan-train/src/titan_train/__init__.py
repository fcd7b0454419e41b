"""The Titan trainer: typed recipes, CLI, parallelism, data, metrics; composes the Titan libraries."""

__version__ = "0.1.0"

from titan_train.config import (
    ActivationCheckpointConfig, CheckpointConfig, CompileConfig, DataConfig, JobConfig, LRScheduleConfig,
    MetricsConfig, ModelConfig, OptimizerConfig, ParallelismConfig, TrainConfig, TrainingConfig,
)
from titan_train.overrides import ConfigError
from titan_train.recipes import load_recipe, recipes, register_recipe
from titan_train.trainer import NonFiniteLossError, TrainResult, train

__all__ = [
    "ActivationCheckpointConfig", "CheckpointConfig", "CompileConfig", "ConfigError", "DataConfig", "JobConfig",
    "LRScheduleConfig", "MetricsConfig", "ModelConfig", "NonFiniteLossError", "OptimizerConfig",
    "ParallelismConfig", "TrainConfig", "TrainResult", "TrainingConfig", "__version__", "load_recipe", "recipes",
    "register_recipe", "train",
]
