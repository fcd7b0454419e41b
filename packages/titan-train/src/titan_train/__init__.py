"""The Titan trainer: typed recipes, CLI, parallelism, data, metrics; composes the Titan libraries."""

__version__ = "0.1.0"

from titan_train.cli_args import ConfigError
from titan_train.config import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    JobConfig,
    LRScheduleConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    QuantizeConfig,
    StepConfig,
    TrainConfig,
)
from titan_train.nonfinite import NonFiniteLossError
from titan_train.recipes import load_recipe, recipes, register_recipe
from titan_train.trainer import TrainResult, train

__all__ = [
    "ActivationCheckpointConfig", "CheckpointConfig", "CompileConfig", "ConfigError", "DataConfig", "JobConfig",
    "LRScheduleConfig", "MetricsConfig", "ModelConfig", "NonFiniteLossError", "OptimizerConfig",
    "ParallelismConfig", "QuantizeConfig", "TrainConfig", "TrainResult", "StepConfig", "__version__", "load_recipe",
    "recipes", "register_recipe", "train",
]
