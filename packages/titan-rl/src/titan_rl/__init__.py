"""RL post-training on the shared model definitions: rollouts, rewards, GRPO-family losses, generators, batch-invariant mode."""

__version__ = "0.1.0"

from titan_rl.algorithms import AlgorithmConfig, dapo, grpo, gspo
from titan_rl.batch_invariant import batch_invariant, is_batch_invariant
from titan_rl.generation import BuiltinGenerator, Completion, Generator, SamplingConfig
from titan_rl.loop import RLConfig, RLLoop, TrainBatch
from titan_rl.rollout import AsyncRollouts, RolloutBatch, Sample, collect_rollouts
from titan_rl.remote_rollouts import RemoteBatch, RemoteRollouts, RolloutServer
from titan_rl.weight_sync import WeightReceiver, WeightSender, full_tensors
from titan_rl.tokenizer import ByteTokenizer, CharTokenizer, Tokenizer
from titan_rl.logprobs import logprobs_from_logits, token_logprobs, token_logprobs_and_entropy
from titan_rl.losses import PolicyLossConfig, PolicyLossOutput, group_advantages, informative_groups, policy_loss

__all__ = [
    "AlgorithmConfig", "BuiltinGenerator", "Completion", "Generator", "PolicyLossConfig", "PolicyLossOutput",
    "AsyncRollouts", "ByteTokenizer", "CharTokenizer", "RLConfig", "RLLoop", "RolloutBatch", "Sample", "Tokenizer",
    "TrainBatch", "collect_rollouts", "RemoteBatch", "RemoteRollouts", "RolloutServer", "WeightReceiver",
    "WeightSender", "full_tensors",
    "SamplingConfig", "batch_invariant", "is_batch_invariant", "logprobs_from_logits", "token_logprobs",
    "token_logprobs_and_entropy",
    "dapo", "grpo", "gspo", "group_advantages", "informative_groups", "policy_loss",
]
