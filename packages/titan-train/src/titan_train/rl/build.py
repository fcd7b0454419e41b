"""From the RL config to titan-rl's objects (task, algorithm, sampling), and the checks that run before
anything is built, so a wrong value fails in a second with the field's name."""
from __future__ import annotations

import importlib.util

from torch import nn

import titan_rl
from titan_rl.envs import ArithmeticTask, CountdownTask, SortingTask, Task
from titan_rl.envs.function_tasks import FunctionTask
from titan_rl.envs.retrieval import KeyValueRetrievalTask

from .config import EnvConfig, RLAlgorithmConfig, RLConfig, RolloutConfig

ALGORITHMS = {"grpo": titan_rl.grpo, "dapo": titan_rl.dapo, "gspo": titan_rl.gspo}



def vllm_installed() -> bool:
    """vLLM importable as a package (a folder named vllm on sys.path, e.g. titan-rl's tests/vllm, is a
    namespace package of no origin, not vLLM)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None

def make_task(env: EnvConfig) -> Task:
    """The verifiable task of `env` (its own checks raise ValueError naming the bad value)."""
    if env.task == "sorting":
        return SortingTask(min_length=env.min_length, max_length=env.max_length)
    if env.task == "arithmetic":
        return ArithmeticTask(max_operand=env.max_operand, ops=env.ops)
    if env.task == "retrieval":
        return KeyValueRetrievalTask(context_chars=env.context_chars)
    if env.task == "code":
        return FunctionTask()  # the training split; the job evaluates on the held-out one
    return CountdownTask(num_numbers=env.num_numbers, max_number=env.max_number)


def make_algorithm(config: RLAlgorithmConfig) -> titan_rl.AlgorithmConfig:
    overrides: dict = {"group_size": config.group_size, "kl_coef": config.kl_coef,
                       "tis_cap": config.tis_cap if config.tis_cap > 0 else None}
    if config.clip_low is not None:
        overrides["clip_low"] = config.clip_low
    if config.clip_high is not None:
        overrides["clip_high"] = config.clip_high
    return ALGORITHMS[config.name](**overrides)


def make_sampling(config: RolloutConfig, *, eos_id: int,
                  stop_sequences: tuple[tuple[int, ...], ...] = ()) -> titan_rl.SamplingConfig:
    """stop_sequences: token ids of the strings that end a turn of a multi-turn episode."""
    return titan_rl.SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                   top_p=config.top_p, stop_token_ids=(eos_id,), stop_sequences=stop_sequences)


def validate(config: RLConfig, *, world_size: int) -> None:
    """Raise ValueError naming the field for every value the job cannot run with."""
    positive = {
        "pretrain.batch_size": config.pretrain.batch_size, "pretrain.seq_len": config.pretrain.seq_len,
        "pretrain.examples": config.pretrain.examples, "rollout.prompts_per_step": config.rollout.prompts_per_step,
        "training.steps": config.training.steps, "training.minibatches": config.training.minibatches,
        "metrics.log_interval": config.metrics.log_interval, "env.max_turns": config.env.max_turns,
        "training.context_parallel": config.training.context_parallel,
        "training.tensor_parallel": config.training.tensor_parallel,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    non_negative = {
        "pretrain.steps": config.pretrain.steps, "pretrain.warmup_steps": config.pretrain.warmup_steps,
        "rollout.max_policy_lag": config.rollout.max_policy_lag, "eval.problems": config.eval.problems,
        "eval.interval": config.eval.interval, "algorithm.tis_cap": config.algorithm.tis_cap,
        "job.threads": config.job.threads,
        "training.max_grad_norm": config.training.max_grad_norm, "training.lr": config.training.lr,
    }
    for name, value in non_negative.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if 0 < config.algorithm.tis_cap < 1:
        raise ValueError(f"algorithm.tis_cap={config.algorithm.tis_cap}: the cap must be >= 1 (or 0 to disable)")
    generators = config.generator.ranks
    if not 0 <= generators < world_size or (generators and world_size < 2):
        raise ValueError(f"generator.ranks={generators} with {world_size} rank(s): must be 0 (colocated) or leave "
                         "at least one of the world's ranks to train (run under torchrun with more ranks)")
    makers = generators or world_size
    if config.rollout.prompts_per_step % makers:
        who = "generator ranks (generator.ranks)" if generators else "ranks"
        raise ValueError(f"rollout.prompts_per_step={config.rollout.prompts_per_step} must be divisible by the "
                         f"number of {who} ({makers}): each generates an equal share of the prompts")
    if config.pretrain.steps and config.pretrain.batch_size % world_size:
        raise ValueError(f"pretrain.batch_size={config.pretrain.batch_size} must be divisible by the number of "
                         f"ranks ({world_size})")
    _validate_trainer_split(config, trainers=world_size - generators)
    if config.generator.kind == "vllm":
        if world_size > 1 and not generators:
            raise ValueError("generator.kind=vllm runs in one process, or on generator ranks (generator.ranks > 0) "
                             "with an engine each; use generator.ranks or generator.kind=builtin under torchrun")
        if not vllm_installed():
            raise ValueError("generator.kind=vllm needs vLLM, which is not installed: install titan-rl[vllm] "
                             "(tools/vllm-env/run.sh builds such an environment) or use generator.kind=builtin")
    try:  # titan-rl's own checks, with the section named
        make_task(config.env)
    except ValueError as e:
        raise ValueError(f"env ({config.env.task}): {e}") from None
    try:
        make_algorithm(config.algorithm)
    except (ValueError, TypeError) as e:
        raise ValueError(f"algorithm: {e}") from None
    try:
        make_sampling(config.rollout, eos_id=0)
    except ValueError as e:
        raise ValueError(f"rollout: {e}") from None


def _validate_trainer_split(config: RLConfig, *, trainers: int) -> None:
    """training.context_parallel and training.tensor_parallel against the trainer ranks and each other."""
    cp, tp = config.training.context_parallel, config.training.tensor_parallel
    who = f"trainer ranks ({trainers}: the world less generator.ranks)" if config.generator.ranks else \
        f"ranks ({trainers})"
    for name, degree in (("context_parallel", cp), ("tensor_parallel", tp)):
        if degree > 1 and trainers % degree:
            raise ValueError(f"training.{name}={degree} must divide the number of {who}")
    if cp > 1 and tp > 1:
        raise ValueError(f"training.context_parallel={cp} with training.tensor_parallel={tp} is not supported yet "
                         "(the ring attention is not built over tensor-parallel heads in the RL trainer); use one")
    if cp > 1 and config.generator.batch_invariant:
        raise ValueError("training.context_parallel > 1 runs ring attention, which has no batch-invariant kernel: "
                         "use generator.batch_invariant=false")
    if tp > 1 and config.generator.batch_invariant:
        raise ValueError("training.tensor_parallel > 1 cannot be batch-invariant: a rowwise-split projection sums "
                         "tp partial products across ranks, in another order than the generator's whole (TP1) matmul, "
                         "so trainer and generator logprobs cannot agree bitwise (and titan-rl's fixed-order modules "
                         "are not the nn.Linear the TP plan splits); use generator.batch_invariant=false")


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """ValueError naming training.tensor_parallel when `model` (on meta) cannot be split `tp` ways."""
    if tp == 1:
        return
    config = model.config
    if model.parallel_plan.experts:
        raise ValueError(f"training.tensor_parallel={tp} with a MoE policy ({config.__class__.__name__}) is not "
                         "supported: titan-train's TP plan leaves the routed experts to expert parallelism, which "
                         "the RL trainer does not run; use a dense policy or training.tensor_parallel=1")
    try:
        model.parallel_plan.check_tensor_parallel(tp)
    except ValueError as e:
        raise ValueError(f"training.tensor_parallel={tp}: {e}") from None
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "ffn_dim": config.ffn_dim,
             "vocab_size": config.vocab_size}
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(f"training.tensor_parallel={tp} does not divide the policy's {name}={value} "
                             "(policy.vocab_size or another flavor changes it)")
    if config.tie_embeddings:
        raise ValueError(f"training.tensor_parallel={tp} with tied embeddings is not supported (the embedding is "
                         "vocabulary-sharded while a tied output weight stays whole); use an untied flavor")
