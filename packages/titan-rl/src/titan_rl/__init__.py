"""RL post-training on the shared model definitions: rollouts, rewards, GRPO-family losses, generators, batch-invariant mode."""

__version__ = "0.1.0"
