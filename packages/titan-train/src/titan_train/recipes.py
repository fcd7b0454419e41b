"""Recipes: Python functions that return a TrainConfig, registered by name.

`titan-train --recipe NAME` picks a registered one; `--recipe my.module:function` imports a user's
own (any zero-argument function returning a TrainConfig); command-line overrides apply on top.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from .cli_args import ConfigError, close_matches
from .config import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    JobConfig,
    LoRAConfig,
    LRScheduleConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    StepConfig,
    TrainConfig,
)

Recipe = Callable[[], TrainConfig]
_RECIPES: dict[str, Recipe] = {}
DEFAULT_RECIPE = "llama3_debug"


def register_recipe(name: str, *, registry: dict[str, Callable] | None = None) -> Callable[[Recipe], Recipe]:
    """Decorator: make `fn` available as `--recipe name`; its docstring's first line is its summary.
    registry: another command's recipes (`titan-train rl` keeps its own); default: the trainer's."""
    registry = _RECIPES if registry is None else registry

    def wrap(fn: Recipe) -> Recipe:
        if name in registry:
            raise ValueError(f"recipe {name!r} is already registered")
        registry[name] = fn
        return fn
    return wrap


def recipes(registry: dict[str, Callable] | None = None) -> dict[str, str]:
    """Registered recipe names -> one-line summaries."""
    registry = _RECIPES if registry is None else registry
    return {name: (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "" for name, fn in registry.items()}


def load_recipe(spec: str, *, registry: dict[str, Callable] | None = None, config_type: type = TrainConfig):
    """The config of a registered recipe name or of `package.module:function` (a `config_type`)."""
    registry = _RECIPES if registry is None else registry
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        if os.getcwd() not in sys.path:  # the console script, unlike python -m, does not look in the cwd
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"--recipe {spec}: cannot import module {module_name!r} ({e})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(f"--recipe {spec}: {module_name} has no function {attr!r}{close_matches(attr, public)}")
    elif spec in registry:
        fn = registry[spec]
    else:
        raise ConfigError(f"unknown recipe {spec!r}{close_matches(spec, sorted(registry))} "
                          "(or give package.module:function)")
    config = fn()
    if not isinstance(config, config_type):
        raise ConfigError(f"--recipe {spec} returned {type(config).__name__}, not a {config_type.__name__}")
    return config


@register_recipe("llama3_debug")
def llama3_debug() -> TrainConfig:
    """The main job: the debug Llama 3 learns Python from the standard library's sources, on a CPU in minutes."""
    return TrainConfig(
        job=JobConfig(folder="runs/llama3_debug"),
        # The byte tokenizer uses 259 ids; 384 (3 x 128) keeps the output matmul aligned and small.
        model=ModelConfig(family="llama3", flavor="debug", vocab_size=384),
        training=StepConfig(steps=100, batch_size=8, seq_len=128, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.3),
        data=DataConfig(source="stdlib", tokenizer="byte"),
    )


@register_recipe("qwen3_vl_debug_shapes")
def qwen3_vl_debug_shapes() -> TrainConfig:
    """The debug Qwen3-VL learns to caption coloured shapes ("a red circle") drawn at run time, on a CPU."""
    return TrainConfig(
        job=JobConfig(folder="runs/qwen3_vl_debug_shapes"),
        model=ModelConfig(family="qwen3_vl", flavor="debug"),  # its 2048-token vocabulary holds the image tokens
        training=StepConfig(steps=100, batch_size=8, seq_len=48, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(kind="wsd", warmup_steps=5, decay_fraction=0.3),
        data=DataConfig(source="shapes", tokenizer="byte", document_masking=False),
    )


@register_recipe("kimi_k25_debug_shapes")
def kimi_k25_debug_shapes() -> TrainConfig:
    """The debug Kimi K2.x (DeepSeek-V3 text model, MoonViT tower) learns the shapes task's captions on a CPU."""
    config = qwen3_vl_debug_shapes()
    config.job.folder = "runs/kimi_k25_debug_shapes"
    # its 2048-token vocabulary holds the image and vision marker tokens (2000-2003)
    config.model = ModelConfig(family="kimi_k25", flavor="debug")
    # at qwen3_vl's 2e-3 for 100 steps the MoonViT tower collapsed (every image the same tokens, captions learned
    # blind) on the H200 host's CPU and in 3 of 12 perturbed runs here (tools/kimi_shapes_robustness.py);
    # 1e-3 for 200 steps read the images in all 12
    config.optimizer.lr = 1e-3
    config.training.steps = 200
    return config


@register_recipe("muse_glimmer_debug_shapes")
def muse_glimmer_debug_shapes() -> TrainConfig:
    """The debug Muse Glimmer with its tower (flavor debug_vision) learns the shapes task's captions on a CPU."""
    config = qwen3_vl_debug_shapes()
    config.job.folder = "runs/muse_glimmer_debug_shapes"
    config.model = ModelConfig(family="muse_glimmer", flavor="debug_vision")
    # its logits are scaled by 0.196 and soft-capped: at qwen3_vl's 2e-3 the loss falls ~4x slower
    config.optimizer.lr = 1e-2
    return config


@register_recipe("llama3_1b")
def llama3_1b() -> TrainConfig:
    """Llama 3.2 1B on GPUs: bf16, FSDP over all ranks, compiled blocks, op-level selective checkpointing."""
    return TrainConfig(
        job=JobConfig(folder="runs/llama3_1b", device="cuda"),
        model=ModelConfig(family="llama3", flavor="1B", attention="flex"),
        training=StepConfig(steps=1000, batch_size=8, seq_len=4096, mixed_precision="bf16"),
        optimizer=OptimizerConfig(lr=3e-4),
        lr_schedule=LRScheduleConfig(kind="wsd", warmup_steps=100, decay_fraction=0.2),
        checkpoint=CheckpointConfig(interval=500),
        compile=CompileConfig(enabled=True),
        activation_checkpoint=ActivationCheckpointConfig(mode="selective", selective="ops"),
    )


def _main_job_on(family: str, folder: str, **model: object) -> TrainConfig:
    """The main job (llama3_debug's data, steps and schedule) on another family's debug flavor, its vocabulary
    cut to 384 (the byte tokenizer's 260 ids with room)."""
    config = llama3_debug()
    config.job.folder = folder
    config.model = ModelConfig(family=family, flavor="debug", vocab_size=384, **model)
    return config


@register_recipe("qwen3_5_debug")
def qwen3_5_debug() -> TrainConfig:
    """The main job on the debug Qwen3.5 (Gated DeltaNet and gated-attention layers alternating), on a CPU."""
    return _main_job_on("qwen3_5", "runs/qwen3_5_debug")


@register_recipe("kimi_linear_debug")
def kimi_linear_debug() -> TrainConfig:
    """The main job on the debug Kimi Linear (Kimi Delta Attention and RoPE-free MLA alternating, a dense first
    layer then 8-expert MoE), on a CPU."""
    return _main_job_on("kimi_linear", "runs/kimi_linear_debug")


@register_recipe("qwen3_next_debug")
def qwen3_next_debug() -> TrainConfig:
    """The main job on the debug Qwen3-Next (Gated DeltaNet + gated attention, 8 experts + gated shared one)."""
    return _main_job_on("qwen3_next", "runs/qwen3_next_debug")


def _debug_moe_ep(family: str, flavor: str, folder: str) -> TrainConfig:
    config = llama3_debug()
    config.job.folder = folder
    # moe_impl auto: dist-moe's layer under ep > 1, titan-models' own with --parallelism.ep 1.
    config.model = ModelConfig(family=family, flavor=flavor, vocab_size=384)
    config.training.moe_bias_update_rate = 1e-3  # DeepSeek-V3's aux-loss-free balancing speed
    config.parallelism = ParallelismConfig(ep=2)
    return config


@register_recipe("qwen3_moe_debug_ep")
def qwen3_moe_debug_ep() -> TrainConfig:
    """The debug Qwen3-MoE (8 experts, top-2) with its experts split over 2 ranks: torchrun --nproc-per-node 2
    (or 4)."""
    return _debug_moe_ep("qwen3", "debug_moe", "runs/qwen3_moe_debug_ep")


@register_recipe("qwen3_next_debug_ep")
def qwen3_next_debug_ep() -> TrainConfig:
    """The debug Qwen3-Next (Gated DeltaNet; 8 experts top-2 + a gated shared expert), expert parallelism 2."""
    return _debug_moe_ep("qwen3_next", "debug", "runs/qwen3_next_debug_ep")


@register_recipe("deepseek_v3_debug_ep")
def deepseek_v3_debug_ep() -> TrainConfig:
    """The debug DeepSeek-V3 (MLA, shared + 8 routed experts) with expert parallelism 2: torchrun, 2 or 4 ranks."""
    return _debug_moe_ep("deepseek_v3", "debug", "runs/deepseek_v3_debug_ep")


@register_recipe("kimi_linear_debug_ep")
def kimi_linear_debug_ep() -> TrainConfig:
    """The debug Kimi Linear (KDA + RoPE-free MLA; shared + 8 routed experts) with expert parallelism 2."""
    return _debug_moe_ep("kimi_linear", "debug", "runs/kimi_linear_debug_ep")


@register_recipe("deepseek_v3_debug_mtp_pp_ep")
def deepseek_v3_debug_mtp_pp_ep() -> TrainConfig:
    """The MLPerf shape in miniature on 8 ranks: debug DeepSeek-V3 + one MTP module, pp 2 x dp 4 with its
    experts split over ep 2 (torchrun --nproc-per-node 8)."""
    config = _debug_moe_ep("deepseek_v3", "debug", "runs/deepseek_v3_debug_mtp_pp_ep")
    config.model.mtp_layers = 1
    config.training.mtp_loss_weight = 0.3
    config.parallelism = ParallelismConfig(pp=2, ep=2, pp_schedule="1F1B", pp_microbatches=2)
    return config


@register_recipe("deepseek_v3_mlperf")
def deepseek_v3_mlperf() -> TrainConfig:
    """DeepSeek-V3 671B + one MTP module as the update's MLPerf run: pp 2 x dp 128 with experts over ep 64 on
    256 GPUs (32 nodes of 8; README: the 256 / 512 GPU table). Point data.source / data.tokenizer at the corpus."""
    return TrainConfig(
        job=JobConfig(folder="runs/deepseek_v3_mlperf"),
        model=ModelConfig(family="deepseek_v3", flavor="671B", mtp_layers=1, moe_impl="dist_moe"),
        # 1024 sequences of 4096 tokens: 8 per data-parallel rank, one per pipeline microbatch
        training=StepConfig(steps=10000, batch_size=1024, seq_len=4096, mixed_precision="bf16", mtp_loss_weight=0.3,
                            moe_bias_update_rate=1e-3),
        optimizer=OptimizerConfig(lr=2.2e-4, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(kind="cosine", warmup_steps=2000, min_lr_ratio=0.1),
        data=DataConfig(source="random"),
        parallelism=ParallelismConfig(pp=2, ep=64, pp_schedule="1F1B", pp_microbatches=8),
        checkpoint=CheckpointConfig(interval=500),
        activation_checkpoint=ActivationCheckpointConfig(mode="full"),
    )


@register_recipe("gpt_oss_debug")
def gpt_oss_debug() -> TrainConfig:
    """The main job with the debug gpt-oss: sinks, sliding-window layers of 64 keys, 8 clamped-SwiGLU experts."""
    config = llama3_debug()
    config.job.folder = "runs/gpt_oss_debug"
    config.model = ModelConfig(family="gpt_oss", flavor="debug", vocab_size=384)
    config.training.moe_bias_update_rate = 0.0  # gpt-oss routes without a selection bias (HF has no place for it)
    return config


@register_recipe("muse_glimmer_debug")
def muse_glimmer_debug() -> TrainConfig:
    """The main job with the debug Muse Glimmer: four norms per layer, 3 sliding (64 keys) : 1 NoPE full
    layers, output gate, normed embeddings, soft-capped logits (the fused loss applies the cap)."""
    return _main_job_on("muse_glimmer", "runs/muse_glimmer_debug")


@register_recipe("muse_spark_debug")
def muse_spark_debug() -> TrainConfig:
    """The main job with the debug Muse Spark: Glimmer's decoder with residual gates, one dense layer and three
    pooled-MoE layers (8 experts, top-2, sigmoid router with a selection bias)."""
    return _main_job_on("muse_spark", "runs/muse_spark_debug")


@register_recipe("deepseek_v4_debug")
def deepseek_v4_debug() -> TrainConfig:
    """The main job with the debug DeepSeek-V4: 2 hyper-connection streams, heavily compressed (16 positions
    per entry) and compressed sparse (4, indexer top-8) attention beside a 16-token window, a hash-routed
    then top-k MoE layers (titan-models' MoE; --parallelism.ep 2 --model.moe_impl dist_moe splits the experts)."""
    return _main_job_on("deepseek_v4", "runs/deepseek_v4_debug", moe_impl="titan")


@register_recipe("llama3_debug_muon")
def llama3_debug_muon() -> TrainConfig:
    """The main job with Muon over flexshard: each hidden matrix whole on one rank, so Muon's step needs no
    communication."""
    config = llama3_debug()
    config.job.folder = "runs/llama3_debug_muon"
    config.optimizer = OptimizerConfig(name="muon", muon_lr=0.05, lr=2e-3, weight_decay=0.1)
    # Attention and MLP matrices owned whole (Muon orthogonalises them where they live); embeddings, norms
    # and the output head (AdamW's) row-sharded as fully_shard would.
    config.parallelism = ParallelismConfig(fsdp_impl="flexshard",
                                           flexshard_placements=(("layers.*.w*.weight", "owned"),))
    return config


@register_recipe("llama3_debug_sft")
def llama3_debug_sft() -> TrainConfig:
    """Supervised fine-tuning of the main job's model on generated arithmetic chats (after the main job).

    Start the main job with --checkpoint.interval 100 so runs/llama3_debug holds its weights."""
    config = llama3_debug()
    config.job.folder = "runs/llama3_debug_sft"
    config.training = StepConfig(steps=60, batch_size=8, seq_len=128, max_grad_norm=1.0)
    config.optimizer = OptimizerConfig(lr=5e-4, weight_decay=0.0)
    config.lr_schedule = LRScheduleConfig(kind="cosine", warmup_steps=5, min_lr_ratio=0.1)
    # Built-in chat template for the byte tokenizer; loss on the assistant's replies only.
    config.data = DataConfig(source="arithmetic_chat", chat=True, tokenizer="byte")
    config.checkpoint = CheckpointConfig(initial_load="runs/llama3_debug", interval=60)
    return config


@register_recipe("llama3_debug_lora")
def llama3_debug_lora() -> TrainConfig:
    """The SFT job with LoRA adapters (rank 8) on the attention projections, the base model frozen."""
    config = llama3_debug_sft()
    config.job.folder = "runs/llama3_debug_lora"
    config.optimizer = OptimizerConfig(lr=2e-3, weight_decay=0.0)
    config.lora = LoRAConfig(targets=("layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv",
                                      "layers.*.attention.wo"), rank=8, alpha=16.0)
    return config
