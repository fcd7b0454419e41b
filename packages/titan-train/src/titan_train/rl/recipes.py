"""RL recipes: functions returning an RLConfig, registered for `titan-train rl --recipe NAME`
(`--recipe package.module:function` loads a user's own)."""
from __future__ import annotations

from collections.abc import Callable

from ..recipes import register_recipe
from .config import (
    EnvConfig,
    EvalConfig,
    GeneratorConfig,
    PolicyConfig,
    PretrainConfig,
    RLAlgorithmConfig,
    RLConfig,
    RLJobConfig,
    RLStepConfig,
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


def _moe_policy(family: str, flavor: str, folder: str) -> RLConfig:
    """The main RL job on a MoE debug policy (2 layers), batch-invariant: the trainer's logprobs equal the
    generator's bitwise (routing included), so logprob_mismatch_max is 0 at every on-policy step."""
    return RLConfig(job=RLJobConfig(folder=folder), policy=PolicyConfig(family=family, flavor=flavor),
                    generator=GeneratorConfig(batch_invariant=True))


@register_recipe("rl_sorting_qwen3_moe", registry=RL_RECIPES)
def rl_sorting_qwen3_moe() -> RLConfig:
    """GRPO on sorting with Qwen3-MoE's debug policy (2 MoE layers of 8 experts, top-2), batch-invariant."""
    return _moe_policy("qwen3", "debug_moe", "runs/rl_sorting_qwen3_moe")


@register_recipe("rl_sorting_deepseek_v3", registry=RL_RECIPES)
def rl_sorting_deepseek_v3() -> RLConfig:
    """GRPO on sorting with DeepSeek-V3's debug policy (MLA; a dense layer, then 8 experts in 2 groups with one
    group kept per token, sigmoid scores, a shared expert), batch-invariant."""
    return _moe_policy("deepseek_v3", "debug", "runs/rl_sorting_deepseek_v3")


@register_recipe("rl_sorting_stable", registry=RL_RECIPES)
def rl_sorting_stable() -> RLConfig:
    """300 GRPO steps on sorting (the 1.8M debug Llama, CPU, one thread) with a KL term to the pretrained policy
    and two minibatches per batch (so the clip acts): the reward rises while the KL and the entropy stay
    bounded; every stability metric per step, rl_curve.png at the end."""
    return RLConfig(job=RLJobConfig(folder="runs/rl_sorting_stable", device="cpu"),
                    algorithm=RLAlgorithmConfig(kl_coef=0.1), training=RLStepConfig(steps=300, minibatches=2),
                    eval=EvalConfig(interval=50))


@register_recipe("rl_code", registry=RL_RECIPES)
def rl_code() -> RLConfig:
    """Multi-turn code execution: the policy writes a list function from examples, may run Python in the
    sandbox (the output comes back as the next turn, masked from the loss) and answers; the reward is the
    fraction of hidden tests passed. Pretrained on solved episodes first; evaluated greedily on held-out problems."""
    return RLConfig(
        job=RLJobConfig(folder="runs/rl_code", device="cpu"),
        env=EnvConfig(task="code", max_turns=2),
        pretrain=PretrainConfig(steps=100, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=5, examples=4000),
        algorithm=RLAlgorithmConfig(name="grpo", group_size=8),
        rollout=RolloutConfig(prompts_per_step=8, max_new_tokens=56, temperature=0.7),
        training=RLStepConfig(steps=20, lr=5e-4),
        eval=EvalConfig(problems=64, interval=10),
    )


@register_recipe("rl_long_context", registry=RL_RECIPES)
def rl_long_context() -> RLConfig:
    """Long-context retrieval (the value of one key among 4k tokens of key=value pairs) with the update's
    sequences split over 2 context-parallel ranks: `torchrun --nproc-per-node 2 -m titan_train rl --recipe
    rl_long_context` (a 1-layer debug Llama, CPU). Pretrained on solved problems first, as every RL job."""
    return RLConfig(
        job=RLJobConfig(folder="runs/rl_long_context", device="cpu"),
        policy=PolicyConfig(num_layers=1),
        env=EnvConfig(task="retrieval", context_chars=4096),
        pretrain=PretrainConfig(steps=20, batch_size=4, seq_len=4608, lr=3e-3, warmup_steps=3, examples=200),
        algorithm=RLAlgorithmConfig(name="grpo", group_size=4),
        rollout=RolloutConfig(prompts_per_step=2, max_new_tokens=4),
        training=RLStepConfig(steps=20, lr=3e-4, context_parallel=2),
        eval=EvalConfig(problems=8, interval=10),
    )
