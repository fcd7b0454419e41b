"""The pretraining phase: titan-train's own trainer learns the task's format from supervised examples.

The examples (prompt + reference answer, one document each, EOS appended by the loader) are written
to `<job.folder>/pretrain/data.jsonl` and trained on like any jsonl corpus: packed rows with document
masking, the fused chunked loss, AdamW with warmup-stable-decay, FSDP over the ranks under torchrun.
What RL needs from it is the model's full weights (a state dict), on rank 0.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    LRScheduleConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    StepConfig,
    TrainConfig,
)
from ..trainer import Trainer, TrainResult
from .config import RLConfig


def policy_model_config(config: RLConfig) -> ModelConfig:
    p = config.policy
    return ModelConfig(family=p.family, flavor=p.flavor, num_layers=p.num_layers, vocab_size=p.vocab_size,
                       attention=p.attention, init_seed=p.init_seed)


def write_examples(demonstration: Callable[[random.Random], str], path: Path, *, examples: int, seed: int) -> None:
    """`examples` solved problems (`demonstration(rng)`: prompt and answer, or a whole solved episode) as
    jsonl documents. They come from one random stream of their own (RL and evaluation build each problem
    from an integer seed), so they are not RL's exact draws; small tasks repeat problems anyway."""
    rng = random.Random(f"titan-train rl pretrain {seed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for _ in range(examples):
            f.write(json.dumps({"text": demonstration(rng)}) + "\n")
    tmp.replace(path)


def pretrain_config(config: RLConfig, data: Path) -> TrainConfig:
    p = config.pretrain
    return TrainConfig(
        job=JobConfig(folder=str(data.parent), seed=config.job.seed, device=config.job.device),
        model=policy_model_config(config),
        training=StepConfig(steps=p.steps, batch_size=p.batch_size, seq_len=p.seq_len, max_grad_norm=1.0),
        optimizer=OptimizerConfig(lr=p.lr, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(kind="wsd", warmup_steps=p.warmup_steps, decay_fraction=0.3),
        data=DataConfig(source=str(data), tokenizer="byte"),
        checkpoint=CheckpointConfig(interval=0, resume=False),
        metrics=MetricsConfig(tensorboard=False, progress=config.metrics.progress,
                              log_interval=config.metrics.log_interval),
    )


def pretrain(config: RLConfig, demonstration: Callable[[random.Random], str],
             device: torch.device) -> tuple[dict[str, torch.Tensor], TrainResult]:
    """Run the supervised phase; returns (the model's full state dict on rank 0, {} elsewhere; the result)."""
    data = Path(config.job.folder) / "pretrain" / "data.jsonl"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        write_examples(demonstration, data, examples=config.pretrain.examples, seed=config.job.seed)
    if dist.is_initialized():
        dist.barrier()  # the file exists before any rank's trainer opens it
    trainer = Trainer(pretrain_config(config, data), device)
    result = trainer.run()
    # Gathered to rank 0's CPU: the RL policy is built afresh (batch-invariant modules, its own FSDP root)
    # and loads these weights the way titan-train materializes any layout.
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full, result
