"""The typed configuration tree of an RL job (`titan-train rl`).

Same conventions as TrainConfig: keyword-only dataclass sections whose fields all have a type, a
default and a docstring, so `titan-train rl --help` lists them and `--section.field value` is checked
against the type. An RL recipe is a Python function returning an `RLConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class RLJobConfig:
    """The `job` section of an RL run (as JobConfig of a training run)."""

    folder: str = "runs/rl_sorting"
    """Where rl_metrics.jsonl, rl_curve.csv, rl_summary.json and pretrain/ (examples, metrics) go."""
    seed: int = 0
    """Seeds the problems (training and held-out), the pretraining examples and the sampling."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available, else cpu."""
    threads: int = 1
    """CPU threads of torch in each process (0: torch's default). One is fastest for the tiny CPU job: its
    matmuls are too small to split, and idle threads spinning on a busy machine cost more (measured 6x)."""


@dataclass(kw_only=True)
class PolicyConfig:
    family: str = "llama3"
    """A titan-models family. The built-in generator and batch-invariant mode run dense and MoE ones (qwen3
    debug_moe, deepseek_v3 debug: recipes rl_sorting_qwen3_moe, rl_sorting_deepseek_v3), not linear attention."""
    flavor: str = "debug"
    """A flavor of that family."""
    num_layers: int = 2
    """Override the flavor's layer count (0 keeps it)."""
    vocab_size: int = 384
    """Override the flavor's vocabulary (0 keeps it); the byte tokenizer needs 259 ids."""
    attention: Literal["default", "sdpa", "flex"] = "default"
    """Attention backend of the trainer's model (the generator runs its own KV-cache attention)."""
    init_seed: int = 0
    """Seed of the initial weights (before pretraining)."""


@dataclass(kw_only=True)
class EnvConfig:
    task: Literal["sorting", "arithmetic", "countdown", "code", "retrieval"] = "sorting"
    """The verifiable-reward task (titan_rl.envs): prompts, reference answers and the reward. code: write
    a small list function from examples, with a sandboxed python tool, scored by hidden tests (multi-turn).
    retrieval: the value of one key among `context_chars` characters of key=value pairs (long context)."""
    min_length: int = 3
    """sorting: fewest digits to sort."""
    max_length: int = 3
    """sorting: most digits to sort."""
    max_operand: int = 99
    """arithmetic: operands are drawn from [0, max_operand]."""
    ops: str = "+"
    """arithmetic: operators to draw from (any of +-*)."""
    num_numbers: int = 4
    """countdown: numbers given per puzzle."""
    max_number: int = 25
    """countdown: largest number given."""
    context_chars: int = 4096
    """retrieval: characters (byte tokens) of key=value context before the query."""
    max_turns: int = 3
    """code: turns per episode (python tool calls, then the answer; an episode without an answer scores 0)."""


@dataclass(kw_only=True)
class PretrainConfig:
    steps: int = 30
    """Supervised steps on the task's prompts + reference answers before RL (0: RL from the initial weights).
    Run by titan-train's own trainer (fused loss, AdamW, schedule, FSDP under torchrun)."""
    batch_size: int = 16
    """Global batch in packed sequences."""
    seq_len: int = 64
    """Tokens per packed sequence (several problems each, attention masked between them)."""
    lr: float = 3e-3
    """Peak learning rate (warmup-stable-decay)."""
    warmup_steps: int = 5
    examples: int = 20000
    """Supervised problems written to <job.folder>/pretrain/data.jsonl (drawn from seeds RL never uses)."""


@dataclass(kw_only=True)
class RLAlgorithmConfig:
    name: Literal["grpo", "dapo", "gspo"] = "grpo"
    """grpo: token ratios, std-normalised group advantages. dapo: clip-higher, dynamic sampling, token-level
    loss. gspo: sequence-level ratios. Each starts from titan_rl's published settings."""
    group_size: int = 8
    """Completions sampled per prompt (advantages are normalised within a group)."""
    clip_low: float | None = None
    """Ratio clip at 1 - clip_low (None: the algorithm's own: 0.2, gspo 3e-4)."""
    clip_high: float | None = None
    """Ratio clip at 1 + clip_high (None: the algorithm's own: 0.2, dapo 0.28, gspo 4e-4)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the policy as RL starts in the loss (0: no KL term)."""
    track_kl: bool = True
    """Keep the policy as RL starts as a reference even when kl_coef is 0, so every step logs the KL to it
    (one more frozen copy and forward per step); with kl_coef > 0 there is always a reference."""
    tis_cap: float = 2.0
    """Truncated importance sampling cap for generator mismatch and stale samples (0 disables)."""


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_step: int = 8
    """Prompts (groups) per RL step, over all ranks: each rank generates an equal share."""
    max_policy_lag: int = 0
    """0: synchronous, on-policy. k > 0: generation runs in a background thread (on generator ranks: ahead
    of the trainer) while the policy trains, from weights at most k versions old (generator ranks wait rather
    than run further ahead; older batches are dropped and counted)."""
    max_new_tokens: int = 8
    """Completion length cap."""
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(kw_only=True)
class GeneratorConfig:
    kind: Literal["builtin", "vllm"] = "builtin"
    """builtin: titan-rl's KV-cache generator on the same definition; vllm: our definition inside vLLM
    (needs `titan-rl[vllm]`; one process, or one engine per generator rank with generator.ranks > 0)."""
    batch_invariant: bool = False
    """Trainer and generator compute with titan-rl's fixed-order kernels: their logprobs agree bitwise."""
    ranks: int = 0
    """Disaggregated generation: the last `ranks` of the world's ranks only generate (each a data-parallel
    generator, TP1, with its own full model and engine), the others only train (FSDP over them, with
    training.tensor_parallel or training.context_parallel). Rollouts
    stream to the trainer; after each update the weights go to the generators by broadcast on a group of
    their own, in the generator's dtype, with the staleness bound of rollout.max_policy_lag. 0: every rank
    trains and generates (a generator inside each trainer process)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The generator's compute dtype, which is also the weights' dtype on the wire (auto: the policy's).
    bfloat16 under an fp32 policy: the generator gets the bf16 rounding of the masters (no bitwise logprobs)."""


@dataclass(kw_only=True)
class RLStepConfig:
    """The `training` section of an RL run: steps and the policy's optimizer."""

    steps: int = 100
    """RL steps (one rollout batch and `minibatches` optimizer steps each)."""
    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    minibatches: int = 1
    """Optimizer steps per rollout batch (the PPO 'old' policy is the batch's start)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    context_parallel: int = 1
    """Trainer ranks that split each sequence of the update (ring attention, titan-train's context parallelism;
    for long contexts); the trainer ranks are context_parallel x data-parallel ones (FSDP over all of them).
    Colocated, every rank still generates its share; with generator.ranks they get the full weights gathered."""
    tensor_parallel: int = 1
    """Trainer ranks that split each layer of the policy (titan-train's TP plan, sequence parallel; needs a
    dense, untied flavor whose heads, ffn and vocabulary it divides); the trainer ranks are a data-parallel (FSDP) x
    tensor_parallel mesh. With generator.ranks the weight sync gathers the shards into the generators' whole
    (TP1) layout. Not with context_parallel > 1 nor generator.batch_invariant (TP sums each rowwise product
    over ranks, in another order than the generator's whole matmul: no bitwise logprobs)."""


@dataclass(kw_only=True)
class EvalConfig:
    problems: int = 128
    """Held-out problems answered greedily before RL, every `interval` steps and at the end (0: no eval)."""
    interval: int = 25
    """Evaluate every this many steps (0: only before and after)."""


@dataclass(kw_only=True)
class RLMetricsConfig:
    progress: bool = True
    """Show progress on rank 0 (a rewritten line on a terminal, a line per log step otherwise)."""
    log_interval: int = 5
    """Print a progress line every this many steps when not on a terminal (every step goes to rl_metrics.jsonl)."""


@dataclass(kw_only=True)
class RLConfig:
    """The whole configuration of a `titan-train rl` run (what an RL recipe returns)."""

    job: RLJobConfig = field(default_factory=RLJobConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    algorithm: RLAlgorithmConfig = field(default_factory=RLAlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    training: RLStepConfig = field(default_factory=RLStepConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: RLMetricsConfig = field(default_factory=RLMetricsConfig)
