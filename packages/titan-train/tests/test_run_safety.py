"""Runs that would lose or mix data stop before writing: a fresh run over an earlier run's checkpoints,
a second run in a folder another run holds; a resumed run takes the command line's optimizer settings
and keeps its metrics on disk from the start; sizes that cannot fit and values that make no sound run
are errors naming the field."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from titan_train import train
from titan_train.cli import main
from titan_train.config import ParallelismConfig
from titan_train.mesh import resolve_degrees
from titan_train.metrics import MetricsWriter
from titan_train.model_setup import model_config
from titan_train.trainer import Trainer


def _steps(folder):
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_fresh_run_over_an_earlier_runs_checkpoints_is_refused(tmp_path, jobs, cli, capsys, monkeypatch):
    train(jobs.tiny(tmp_path, **{"training.steps": "2", "checkpoint.interval": "2"}))
    before = (tmp_path / "metrics.jsonl").read_text()
    with monkeypatch.context() as patch:  # refused before the model is built
        patch.setattr("titan_train.parallelizer.build_on_meta",
                      lambda cfg: pytest.fail("the refused run built its model"))
        for interval in ("2", "0"):  # with or without checkpoints of its own, the new run would mix its lines in
            with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(steps 2\) and checkpoint."
                                                 r"resume is false.*--checkpoint.resume true.*another --job.folder"):
                train(jobs.tiny(tmp_path, **{"training.steps": "3", "checkpoint.interval": interval}))
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing of the refused runs was written
    assert main([*cli.TINY, "--job.folder", str(tmp_path), "--training.steps", "3"]) == 2
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err
    # Resuming it, or a fresh run in another folder, goes ahead.
    assert train(jobs.tiny(tmp_path, **{"training.steps": "3", "checkpoint.resume": "true"})).start_step == 2
    assert _steps(tmp_path) == [1, 2, 3]


def test_second_run_in_a_folder_is_refused_naming_the_first_ones_pid(tmp_path, jobs, cli, capsys):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from titan_train.run_folder import RunFolderLock
        lock = RunFolderLock(Path({str(tmp_path)!r}))
        print("locked", flush=True)
        sys.stdin.read()  # hold the lock until the test closes stdin
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cli.env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"job.folder .* is in use by another run \(PID {holder.pid} on "):
            train(jobs.tiny(tmp_path, **{"training.steps": "1"}))
        assert not (tmp_path / "metrics.jsonl").exists()
        assert main([*cli.TINY, "--job.folder", str(tmp_path), "--training.steps", "1"]) == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # The holder is gone (the kernel dropped its lock): a run goes ahead, and releases the lock when done.
    train(jobs.tiny(tmp_path, **{"training.steps": "1"}))
    train(jobs.tiny(tmp_path, **{"training.steps": "1"}))
    assert _steps(tmp_path) == [1]


def test_resume_applies_the_command_lines_optimizer_settings(tmp_path, jobs, capsys):
    job = {"lr_schedule.kind": "constant", "lr_schedule.warmup_steps": "0", "checkpoint.interval": "2",
           "checkpoint.resume": "true"}
    train(jobs.tiny(tmp_path, **job, **{"training.steps": "2", "optimizer.lr": "0.003"}))
    capsys.readouterr()
    new = {"training.steps": "4", "optimizer.lr": "0.01", "optimizer.beta2": "0.99", "optimizer.weight_decay": "0.0"}
    trainer = Trainer(jobs.tiny(tmp_path, **job, **new), torch.device("cpu"))
    assert trainer.run().start_step == 2
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert [records[s]["lr"] for s in (1, 2, 3, 4)] == [0.003, 0.003, 0.01, 0.01]
    for group in trainer.optimizer.param_groups:
        assert group["lr"] == group["initial_lr"] == 0.01 and tuple(group["betas"]) == (0.9, 0.99)
        assert group["weight_decay"] == 0.0
    out = capsys.readouterr().out
    assert "resuming after step 2 with the command line's optimizer settings" in out
    assert "lr (peak) 0.003 -> 0.01" in out and "betas (0.9, 0.95) -> (0.9, 0.99)" in out

    # The same settings as the checkpoint's: nothing reported, the schedule continues from the checkpoint.
    train(jobs.tiny(tmp_path, **job, **{**new, "training.steps": "5"}))
    out = capsys.readouterr().out
    assert "resuming after step 4" in out and "optimizer settings" not in out


def test_metrics_kept_on_disk_from_the_start_of_a_resumed_run(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 7, "lo')  # killed mid-line
    writer = MetricsWriter(tmp_path, tensorboard=False, start_step=4)
    # Before any new line (a kill during the first step after the resume), the kept records are on disk.
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:4]
    writer.write({"step": 5, "loss": 0.5})
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]  # each line reaches the file as it is written
    writer.close()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_run_killed_in_its_first_step_after_a_resume_keeps_its_metrics(tmp_path, jobs, cli):
    job = {"training.steps": "4", "checkpoint.interval": "2", "checkpoint.resume": "true",
           "checkpoint.async_save": "false", "job.folder": str(tmp_path)}
    train(jobs.tiny(tmp_path, **job))
    with open(tmp_path / "metrics.jsonl", "a") as f:  # as if the run had gone on past step 4 when killed
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + '{"step": 6, "lo')
    # The resumed run (after step 4, up to step 8) is SIGKILLed inside its first step.
    script = textwrap.dedent(f"""
        import os, signal
        from titan_train import load_recipe, train
        from titan_train.cli_args import apply_override
        from titan_train.trainer import Trainer
        config = load_recipe("llama3_debug")
        for name, value in {{**{dict(zip(cli.TINY[0::2], cli.TINY[1::2]))!r}, **{job!r}}}.items():
            apply_override(config, name.removeprefix("--"), value)
        config.training.steps = 8
        Trainer.train_step = lambda self, step: os.kill(os.getpid(), signal.SIGKILL)
        train(config)
        """)
    killed = subprocess.run([sys.executable, "-c", script], env=cli.env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "resuming after step 4" in killed.stdout
    assert _steps(tmp_path) == [1, 2, 3, 4]  # the checkpoint's records, none lost, the redone one gone


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("training.max_grad_norm", "nan", "training.max_grad_norm must be a finite number >= 0"),
    ("training.max_grad_norm", "-1", "training.max_grad_norm must be a finite number >= 0"),
    ("job.folder", "", "job.folder is empty"),
    ("job.folder", "  ", "job.folder is empty"),
    ("job.seed", "-1", r"job.seed must be in [0, 2**32), got -1"),
    ("job.seed", str(2**64), "job.seed must be in [0, 2**32)"),
    ("optimizer.lr", "inf", "optimizer.lr must be a finite number >= 0"),
    ("optimizer.beta2", "1.5", "optimizer.beta2 must be in [0, 1)"),
])
def test_values_that_make_no_sound_run_are_errors_naming_the_field(tmp_path, monkeypatch, cli, capsys,
                                                                   flag, value, message):
    monkeypatch.chdir(tmp_path)  # an empty job.folder would otherwise be the working directory
    args = [*cli.TINY, "--job.folder", str(tmp_path / "run"), "--training.steps", "1", f"--{flag}", value]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_sizes_that_cannot_fit_are_refused_with_the_estimate(tmp_path, jobs, monkeypatch):
    # Sequences of 2**40 tokens: terabytes of activations on any machine (before this check, the loader's
    # first row allocation failed with a MemoryError after the model was built).
    config = jobs.tiny(tmp_path, **{"training.seq_len": str(2**40), "training.batch_size": "4"})
    with pytest.raises(ValueError, match=r"training.seq_len=1099511627776 x training.batch_size=4 cannot fit: each "
                                         r"rank needs at least \d+\.\d GiB \(activations \d+\.\d.* GiB free"):
        train(config)
    assert not (tmp_path / "metrics.jsonl").exists()

    # The bound against an independent count of the tiny job (2 layers, dim 256, ffn 768, fp32): a batch
    # that fits a device with 1 GiB free, and one that does not.
    import titan_train.memory_estimate as memory

    model_cfg = model_config(config.model, vocab_needed=0)
    assert (model_cfg.dim, model_cfg.num_layers, model_cfg.ffn_dim) == (256, 2, 768)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**30)
    fits = jobs.tiny(tmp_path / "fits", **{"training.seq_len": "1024", "training.batch_size": "16"})
    need = memory.estimate(fits, model_cfg, _one_rank(), device=torch.device("cpu"), n_params=1)
    assert need.activations == 16 * 1024 * 2 * (4 * 256 + 2 * 768) * 4  # 0.31 GiB
    memory.check_memory_fits(fits, model_cfg, _one_rank(), device=torch.device("cpu"), n_params=1)
    too_big = jobs.tiny(tmp_path / "big", **{"training.seq_len": "8192", "training.batch_size": "64"})
    with pytest.raises(ValueError, match="cannot fit"):
        Trainer(too_big, torch.device("cpu"))


def test_the_activation_bound_follows_which_layers_may_be_checkpointed(tmp_path, jobs):
    # remat may recompute every block, so its bound is full checkpointing's (it was counted as mode none's,
    # refusing an 8B at batch 16 x 4096 on an H200 that full checkpointing's bound admitted); selective
    # layers every 2 checkpoints layers 0 and 2 of 3 (parallelize.py).
    import titan_train.memory_estimate as memory

    tokens, dim, block = 2 * 128, 256, 4 * 256 + 2 * 768  # the tiny job: fp32, dim 256, ffn 768
    expected = {"full": tokens * (3 * dim + block) * 4, "remat": tokens * (3 * dim + block) * 4,
                "layers2": tokens * (2 * dim + 1 * block + block) * 4, "ops": tokens * 3 * block * 4,
                "none": tokens * 3 * block * 4}
    flags = {"full": {"activation_checkpoint.mode": "full"}, "remat": {"activation_checkpoint.mode": "remat"},
             "layers2": {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective": "layers",
                         "activation_checkpoint.every": "2"},
             "ops": {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective": "ops"},
             "none": {"activation_checkpoint.mode": "none"}}
    found = {}
    for name, overrides in flags.items():
        config = jobs.tiny(tmp_path / name, **{"model.num_layers": "3", "training.batch_size": "2",
                                               "training.seq_len": "128", **overrides})
        model_cfg = model_config(config.model, vocab_needed=0)
        found[name] = memory.estimate(config, model_cfg, _one_rank(), device=torch.device("cpu"),
                                      n_params=1).activations
    assert found == expected


def test_the_estimate_counts_12_bytes_a_parameter_with_bf16_moments(tmp_path, jobs):
    import titan_train.memory_estimate as memory

    counts = {}
    for name, overrides in {"fp32": {}, "bf16_params": {"training.mixed_precision": "bf16_params"},
                            "bf16_moments": {"training.mixed_precision": "bf16_params",
                                             "optimizer.moment_dtype": "bfloat16"}}.items():
        config = jobs.tiny(tmp_path / name, **overrides)
        model_cfg = model_config(config.model, vocab_needed=0)
        counts[name] = memory.estimate(config, model_cfg, _one_rank(), device=torch.device("cpu"), n_params=1000).states
    # fp32: weight, gradient, two moments; bf16_params: bf16 weight and gradient, fp32 master and moments (16
    # either way); bf16 moments: 2 + 2 + 4 + 2 + 2
    assert counts == {"fp32": 16000, "bf16_params": 16000, "bf16_moments": 12000}


def _one_rank():
    return resolve_degrees(ParallelismConfig(), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares against the free memory of a CUDA device")
def test_sizes_that_cannot_fit_a_gpu_are_refused(tmp_path, jobs):
    import titan_train.memory_estimate as memory

    free = torch.cuda.mem_get_info()[0]
    config = jobs.tiny(tmp_path, **{"training.seq_len": str(2**24), "training.batch_size": "64", "job.device": "cuda"})
    with pytest.raises(ValueError, match=r"cannot fit: each rank needs at least .* but cuda has \d+\.\d GiB free"):
        train(config)
    fits = jobs.tiny(tmp_path, **{"job.device": "cuda"})
    model_cfg = model_config(fits.model, vocab_needed=0)
    need = memory.estimate(fits, model_cfg, _one_rank(), device=torch.device("cuda"), n_params=10**6)
    assert need.total < free
    memory.check_memory_fits(fits, model_cfg, _one_rank(), device=torch.device("cuda"), n_params=10**6)
