"""Multi-token prediction (DeepSeek-V3 debug, one MTP module) composed with tensor and context parallelism on
gloo ranks, each following the single-process curve of the same job: the main loss, the MTP loss and the
gradient norm, over 10 steps, within titan_train_curves.tolerance.

Under TP the MTP block is split like the main blocks (its norms sequence-parallel, the projection of
[embedded next token; hidden] replicated on each rank's tokens, its MLA and MoE as the plan's) and its loss
is the shared vocabulary-parallel head's. Under CP the MTP targets and next-token ids are shifted on whole
sequences before the load-balanced chunking (a position at a chunk's end takes its next tokens from another
rank), and the MTP block's attention runs around the ring. The job packs documents, so the document masks
and the MTP targets they cut are exercised too. Controls run by hand on this job (cp2, step 1's MTP loss,
6.5510 in one process): the shift taken within each cp rank's chunks gives 6.335; the MTP block's attention
left local (no ring) 6.5521, 1.6e-4 off, outside the 1e-4 bound and growing with the steps; tp2 x ep2 with
eh_proj's gradient not summed over tp (style replicate_whole) moves step 1's gradient norm 2.413 -> 2.089.

Time: about 30 s (cp2) and 70 s (tp2 x ep2, 4 ranks) on the shared 2-core machine, nearly all of it
starting the spawned ranks; the steps themselves are tiny.
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
    (2, {"parallelism.cp": "2"}),
    # TP on DeepSeek-V3 needs ep > 1 (routed experts are not TP-split; the MTP block is a MoE block too)
    (4, {"parallelism.tp": "2", "parallelism.dp_shard": "2", "parallelism.ep": "2"}),
], ids=["cp2", "tp2xep2"])
def test_mtp_follows_one_process(reference, tmp_path, jobs, nproc, layout):
    folder = tmp_path / "run"
    jobs.on_ranks(job(folder, **layout), nproc)
    assert_records_follow(records(folder), reference)


def test_tp_on_a_moe_model_without_ep_is_an_error():
    """Even where every main layer is dense (num_layers 1: DeepSeek-V3's first layer), the MTP block is a MoE one."""
    import dataclasses

    import torch

    import titan_models as tm
    from titan_train.parallelize import check_moe_under_tp

    config = dataclasses.replace(tm.transforms.num_layers(1)(tm.flavor("deepseek_v3", "debug")), mtp=True)
    with torch.device("meta"):
        model = config.build()
    with pytest.raises(ValueError, match="parallelism.tp=2 on a MoE model needs parallelism.ep > 1"):
        check_moe_under_tp(model, tp=2, ep=1)
    check_moe_under_tp(model, tp=2, ep=2)
    with torch.device("meta"):
        check_moe_under_tp(dataclasses.replace(config, mtp=False).build(), tp=2, ep=1)  # dense: TP splits it all

