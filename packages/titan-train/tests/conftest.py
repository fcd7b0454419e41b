"""Fixtures: the tiny job, the real `titan-train` command in a subprocess, and gloo ranks running train().

Ranks are spawned (titan_train_ranks.py says why not forked), each with one thread and
OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_train import TrainConfig, load_recipe
from titan_train.cli_args import apply_override

# pytest runs with --import-mode=importlib, which does not put test folders on sys.path; the helper
# module has a package-specific name so it cannot shadow another package's helpers.
sys.path.insert(0, str(Path(__file__).parent))
os.environ["OMP_NUM_THREADS"] = "1"  # spawned ranks inherit it before they import torch
torch.set_num_threads(1)  # one thread per process: the machine is shared, and runs stay reproducible

from titan_train_curves import assert_follows  # noqa: E402
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks  # noqa: E402

# A tiny, fast job: the debug Llama cut to 2 layers, short sequences, fp32 on CPU, nothing to resume.
# job.device cpu: on a GPU machine "auto" would put every gloo rank of a CPU test on cuda:LOCAL_RANK.
TINY = {"job.device": "cpu", "model.num_layers": "2", "training.seq_len": "64", "training.batch_size": "4",
        "metrics.tensorboard": "false",
        "metrics.progress": "false", "lr_schedule.warmup_steps": "2", "checkpoint.resume": "false"}


def tiny_config(folder: Path, recipe: str = "llama3_debug", **overrides: str) -> TrainConfig:
    config = load_recipe(recipe)
    for name, value in {**TINY, "job.folder": str(folder), **overrides}.items():
        apply_override(config, name, value)
    return config


def as_args(overrides: dict[str, str]) -> list[str]:
    return [part for name, value in overrides.items() for part in (f"--{name}", value)]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def command(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "titan_train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "titan_train", *args]


def run(args: list[str], *, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command(args, nproc), env=env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"titan-train {' '.join(args)} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result


def losses(folder: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a later line for the same step wins: a resumed run)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def _rank_main(rank: int, world: int, init_method: str, configs: list[TrainConfig]) -> None:
    import torch.distributed as dist

    from titan_train import train

    join_gloo(rank, world, init_method)
    try:
        for config in configs:  # in turn, in one process group (train() joins the existing one)
            train(config)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # torch sometimes aborts at interpreter exit after gloo


def train_on_ranks(config: TrainConfig, nproc: int) -> dict[int, float]:
    """Run train(config) on `nproc` gloo ranks; the loss curve rank 0 wrote."""
    return train_each_on_ranks([config], nproc)[0]


def train_each_on_ranks(configs: list[TrainConfig], nproc: int) -> list[dict[int, float]]:
    """Run train() of each config in turn on the same `nproc` gloo ranks (one spawn: each rank imports torch
    and joins the group once, about 3.5 s of CPU per rank); the loss curve of each, as rank 0 wrote it."""
    configs = list(configs)
    with tempfile.TemporaryDirectory(prefix="titan-rendezvous-") as folder:
        spawn_ranks(_rank_main, nproc, (nproc, file_rendezvous(folder), configs))
    return [losses(Path(config.job.folder)) for config in configs]


def train_folders_on_ranks(root: Path, runs: dict[str, dict[str, str]], nproc: int) -> dict[str, Path]:
    """Each run (id -> tiny_config overrides) trained in root / id, all in one spawn of `nproc` gloo ranks;
    id -> its job folder."""
    train_each_on_ranks([tiny_config(root / name, **overrides) for name, overrides in runs.items()], nproc)
    return {name: root / name for name in runs}


@pytest.fixture(autouse=True)
def _allocator_env_restored():
    """main() sets the CUDA allocator's default in os.environ (cli.default_cuda_allocator): undone after each
    test, so a test's environment does not depend on which tests ran before it in the worker."""
    saved = {name: os.environ.get(name) for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def cli():
    """cli.run(args, nproc=1), cli.command(args, nproc), cli.env(), cli.losses(folder), cli.TINY (as args)."""
    return SimpleNamespace(run=run, command=command, env=env, losses=losses, TINY=as_args(TINY))


@pytest.fixture(scope="session")
def jobs():
    """jobs.tiny(folder, **overrides) -> TrainConfig; jobs.on_ranks(config, nproc) -> loss curve;
    jobs.each_on_ranks(configs, nproc): several runs, one spawn; jobs.folders_on_ranks(root, runs, nproc): runs by
    id, one spawn, id -> folder; jobs.assert_follows(curve, expected): a parallel curve against the single-process
    one."""
    return SimpleNamespace(tiny=tiny_config, on_ranks=train_on_ranks, each_on_ranks=train_each_on_ranks,
                           folders_on_ranks=train_folders_on_ranks, assert_follows=assert_follows)
