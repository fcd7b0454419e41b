"""Checkpoint and resume: a run killed with SIGKILL after a checkpoint and resumed gives bitwise the
losses of the run that was never stopped (CPU, one process each); a non-finite loss stops the run
naming the step and leaves only good checkpoints behind."""
from __future__ import annotations

import json
import math
import signal
import subprocess

import pytest
import torch

from titan_train import NonFiniteLossError, train
from titan_train.cli import main
from titan_train.trainer import Trainer
from torch_checkpointing import Checkpointer

STEPS, INTERVAL, KILL_AFTER = 14, 4, 6


def test_kill_and_resume_matches_the_uninterrupted_run(tmp_path, cli, jobs):
    job = {"training.steps": str(STEPS), "checkpoint.interval": str(INTERVAL)}
    uninterrupted = train(jobs.tiny(tmp_path / "whole", **job)).losses

    folder = tmp_path / "killed"
    # Blocking saves: when step KILL_AFTER's progress line appears, step 4's checkpoint is committed.
    args = [*cli.TINY, *(p for k, v in job.items() for p in (f"--{k}", v)), "--job.folder", str(folder),
            "--checkpoint.async_save", "false", "--metrics.progress", "true", "--checkpoint.resume", "true"]
    proc = subprocess.Popen(cli.command(args), env=cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if f"step {KILL_AFTER}/{STEPS}" in line:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed: {proc.stderr.read()[-2000:]}"
    killed_at = max(json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines())
    assert KILL_AFTER <= killed_at < STEPS

    result = cli.run(args)  # resumes from the newest committed checkpoint
    assert f"resuming after step {INTERVAL}" in result.stdout
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the redone steps logged once
    resumed = cli.losses(folder)
    assert resumed == uninterrupted  # bitwise: JSON floats round-trip exactly


def test_non_finite_loss_stops_the_run_without_a_bad_checkpoint(tmp_path, cli, jobs, capsys):
    # A learning rate of 1e6 blows the tiny model up within a few steps (deterministically on CPU).
    job = {"training.steps": "10", "checkpoint.interval": "1", "optimizer.lr": "1e6",
           "lr_schedule.warmup_steps": "0", "checkpoint.keep_last": "0"}
    with pytest.raises(NonFiniteLossError) as stop:
        train(jobs.tiny(tmp_path, **job))
    bad = stop.value.step
    assert 2 <= bad < 10 and f"at step {bad}" in str(stop.value)
    assert not (math.isfinite(stop.value.loss) and math.isfinite(stop.value.grad_norm))
    with Checkpointer(str(tmp_path / "checkpoints")) as checkpoints:
        assert checkpoints.steps() == list(range(1, bad))  # the good steps only
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, bad))

    # The command line says the same and exits 1; resuming starts from the last good step.
    args = [*(p for k, v in {**job, "job.folder": str(tmp_path)}.items() for p in (f"--{k}", v))]
    assert main([*cli.TINY, *args, "--checkpoint.resume", "true"]) == 1
    out, err = capsys.readouterr()
    assert f"resuming after step {bad - 1}" in out
    assert "titan-train: stopped: non-finite" in err and f"at step {bad}" in err


def test_non_finite_step_is_skipped_on_the_device_and_named_at_the_read_back(tmp_path, jobs):
    """Fused AdamW skips updates on the device (found_inf): reading back every 4 steps instead of every
    step stops at the same first non-finite step, and neither it nor a later step was applied (the weights
    stay finite; an applied NaN gradient would make them NaN)."""
    job = {"training.steps": "10", "optimizer.lr": "1e6", "lr_schedule.warmup_steps": "0",
           "optimizer.implementation": "fused"}
    with pytest.raises(NonFiniteLossError) as every_step:
        train(jobs.tiny(tmp_path / "every", **job))
    trainer = Trainer(jobs.tiny(tmp_path / "batched", **job, **{"metrics.log_interval": "4"}), torch.device("cpu"))
    assert trainer.guard.on_device
    with pytest.raises(NonFiniteLossError) as batched:
        trainer.run()
    bad = every_step.value.step
    assert batched.value.step == bad and f"at step {bad}" in str(batched.value)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    metrics = [json.loads(line)["step"] for line in (tmp_path / "batched" / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [s for s in range(4, bad, 4)]


def test_resume_in_another_layout(tmp_path, jobs):
    """A checkpoint written by FSDP2 x TP2 (DTensor shards) resumes in one process and continues the
    single-process curve (constant schedule, so the shorter first run changes nothing else)."""
    job = {"lr_schedule.kind": "constant", "checkpoint.interval": "3", "checkpoint.resume": "true"}
    reference = train(jobs.tiny(tmp_path / "single", **job, **{"training.steps": "6"})).losses
    folder = tmp_path / "moved"
    jobs.on_ranks(jobs.tiny(folder, **job, **{"training.steps": "3", "parallelism.dp_shard": "2",
                                                "parallelism.tp": "2"}), 4)
    resumed = train(jobs.tiny(folder, **job, **{"training.steps": "6"}))
    assert resumed.start_step == 3 and sorted(resumed.losses) == [4, 5, 6]
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-4)  # the tolerance of test_parallel.py
