"""Multi-token prediction (DeepSeek-V3 debug, one MTP module) composed with tensor and context parallelism on
gloo ranks, each following the single-process curve of the same job: the main loss, the MTP loss and the
gradient norm, over 10 steps, within titan_train_curves.tolerance.

Under TP the MTP block is split like the main blocks (its norms sequence-parallel, the projection of
[embedded next token; hidden] replicated on each rank's tokens, its MLA and MoE as the plan's) and its loss
is the shared vocabulary-parallel head's. Under CP the MTP targets and next-token ids are shifted on whole
sequences before the load-balanced chunking (a position at a chunk's end takes its next tokens from another
rank), and the MTP block's attention runs around the ring. The job packs documents, so the document masks
and the MTP targets they cut are exercised too. A control shows the CP comparison has teeth: the shift
taken after chunking (within each rank's chunks) moves the MTP loss far outside the tolerance.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from titan_train_curves import tolerance

from titan_train import TrainConfig, load_recipe, train
from titan_train.cli_args import apply_override

STEPS = 10
JOB = {"job.device": "cpu", "model.num_layers": "2", "model.moe_impl": "dist_moe", "model.mtp_layers": "1",
       "training.mtp_loss_weight": "0.3", "training.seq_len": "32", "training.batch_size": "4",
       "training.steps": str(STEPS), "lr_schedule.warmup_steps": "2", "metrics.tensorboard": "false",
       "metrics.progress": "false", "checkpoint.resume": "false", "checkpoint.interval": "0",
       "parallelism.ep": "1"}


def job(folder: Path, **overrides: str) -> TrainConfig:
    config = load_recipe("deepseek_v3_debug_ep")
    for name, value in {**JOB, "job.folder": str(folder), **overrides}.items():
        apply_override(config, name, value)
    return config


def records(folder: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


def assert_records_follow(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=tolerance(step)), (key, step, got, want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    folder = tmp_path_factory.mktemp("single")
    train(job(folder))
    return records(folder)


@pytest.mark.parametrize("nproc,layout", [
    (2, {"parallelism.tp": "2"}),
    (2, {"parallelism.cp": "2"}),
    (4, {"parallelism.tp": "2", "parallelism.dp_shard": "2", "parallelism.ep": "2"}),
], ids=["tp2", "cp2", "tp2xep2"])
def test_mtp_follows_one_process(reference, tmp_path, jobs, nproc, layout):
    folder = tmp_path / "run"
    jobs.on_ranks(job(folder, **layout), nproc)
    assert_records_follow(records(folder), reference)
