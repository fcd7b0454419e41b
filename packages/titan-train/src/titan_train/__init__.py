"""The Titan trainer: typed recipes, CLI, parallelism, data, metrics; composes the Titan libraries."""

__version__ = "0.1.0"
