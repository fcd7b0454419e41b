"""RL post-training on the shared model definitions: rollouts, rewards, GRPO-family losses, generators, batch-invariant mode."""

__version__ = "0.1.0"

from titan_rl.algorithms import AlgorithmConfig, dapo, grpo, gspo
from titan_rl.losses import PolicyLossConfig, PolicyLossOutput, group_advantages, informative_groups, policy_loss

__all__ = [
    "AlgorithmConfig", "PolicyLossConfig", "PolicyLossOutput",
    "dapo", "grpo", "gspo", "group_advantages", "informative_groups", "policy_loss",
]
