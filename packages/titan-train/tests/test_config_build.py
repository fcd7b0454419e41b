"""The config sections build what they describe (the trainer only composes them)."""
from __future__ import annotations

import pytest
import torch

from titan_train import CheckpointConfig, LRScheduleConfig, OptimizerConfig, ParallelismConfig, load_recipe
from titan_train.lr_schedule import lr_factor


def test_schedule_and_optimizer_build_from_their_sections():
    model = torch.nn.Linear(4, 4)
    optimizer = OptimizerConfig(lr=0.5, weight_decay=0.25).build(model, device=torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.25, 0.0]  # matrices decay, vectors do not
    section = LRScheduleConfig(kind="wsd", warmup_steps=3, decay_fraction=0.5)
    schedule = section.build(optimizer, total_steps=10)
    rates = []
    for _ in range(10):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert rates == [0.5 * lr_factor(step, 10, section) for step in range(10)]


def test_checkpoints_are_built_only_when_saved_or_resumed(tmp_path):
    assert CheckpointConfig(interval=0, resume=False).build(tmp_path) is None
    assert CheckpointConfig(interval=2, resume=False).build(tmp_path) is not None
    with pytest.raises(ValueError, match="checkpoint.interval and checkpoint.keep_last must be >= 0"):
        CheckpointConfig(interval=-1).check()


def test_parallelism_build_checks_the_layout_against_the_recipe():
    run = load_recipe("llama3_debug")
    layout = run.parallelism.build(run, world_size=1, device=torch.device("cpu"))
    assert (layout.degrees.dp, layout.mesh, layout.loss_scale(64)) == (1, None, 1 / 64)
    run.parallelism = ParallelismConfig(tp=2)
    with pytest.raises(ValueError, match=r"world size 1 is not divisible by dp_replicate \* tp \* pp \* cp = 2"):
        run.parallelism.build(run, world_size=1, device=torch.device("cpu"))
    run.parallelism, run.training.batch_size = ParallelismConfig(dp_shard=3), 8
    with pytest.raises(ValueError, match=r"training.batch_size=8 must be divisible by the data-parallel degree \(3\)"):
        run.parallelism.build(run, world_size=3, device=torch.device("cpu"))
