"""DualPipeV with the expert all-to-alls overlapped (parallelism.pp_overlap_ep, pipeline_overlap.py).
The turns themselves (their recorded order, bitwise results) are tested in dist-moe (tests/ep_worker.py).

- The recipe checks: DualPipeV, pp >= 2 and ep >= 2 only.
- PP2 x EP2 on 4 gloo ranks (DeepSeek-V3 debug, 4 layers: one dense and three MoE, one per stage but the
  first; full activation checkpointing as in the MLPerf recipe, so the backward's recomputed forward makes
  its exchanges inside B's turn too): overlapped, the run gives bitwise the losses and gradient norms of
  plain DualPipeV (steps 1-3: the design promises the sequential arithmetic) and follows the
  single-process curve over 10 steps within the layout tests' tolerance (titan_train_curves.py); every
  rank handed its turn over.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from titan_train_curves import assert_pairs_follow
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks
from torch.distributed.pipelining import PipelineStage

import dist_moe
from titan_train import ParallelismConfig, load_recipe, train
from titan_train.cli_args import apply_override
from titan_train.pipeline_overlap import check_pipeline_overlap

V_ON_GLOO = hasattr(PipelineStage, "_is_same_rank")  # older pipelining sends to its own rank at the V's turn


@pytest.mark.parametrize("fields,message", [
    ({"pp": 2, "pp_schedule": "1F1B", "ep": 2}, "needs parallelism.pp_schedule=DualPipeV and pp >= 2"),
    ({"pp": 1, "pp_schedule": "DualPipeV", "ep": 2}, "pp >= 2, got pp_schedule=DualPipeV with pp=1"),
    ({"pp": 2, "pp_schedule": "DualPipeV", "ep": 1}, "needs parallelism.ep >= 2, got ep=1"),
])
def test_overlap_needs_dualpipev_and_expert_parallelism(fields, message):
    with pytest.raises(ValueError, match=message):
        check_pipeline_overlap(ParallelismConfig(pp_overlap_ep=True, **fields))
    check_pipeline_overlap(ParallelismConfig(**fields))  # off: nothing to check


STEPS = 10
JOB = {"job.device": "cpu", "training.batch_size": "8", "training.seq_len": "32", "training.steps": str(STEPS),
       "model.num_layers": "4", "model.moe_impl": "dist_moe", "metrics.tensorboard": "false",
       "metrics.progress": "false", "lr_schedule.warmup_steps": "2", "checkpoint.resume": "false",
       "checkpoint.interval": "0", "activation_checkpoint.mode": "full"}
DUALPIPEV = {"parallelism.pp": "2", "parallelism.dp_shard": "2", "parallelism.ep": "2",
             "parallelism.pp_schedule": "DualPipeV", "parallelism.pp_microbatches": "4"}


def _job(folder: Path, **overrides: str):
    config = load_recipe("deepseek_v3_debug_ep")
    for name, value in {**JOB, "job.folder": str(folder), **overrides}.items():
        apply_override(config, name, value)
    return config


def _curve(folder: Path) -> dict[int, tuple[float, float]]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def _overlapped_then_plain_rank(rank: int, world: int, init_method: str, overlapped, plain) -> None:
    """Both runs in one launch (spawning 4 ranks costs more than a run); counts this rank's hand-overs."""
    import torch.distributed as dist

    join_gloo(rank, world, init_method)
    hand_overs = []
    original = dist_moe.TakingTurns.hand_over

    def counted(self):
        if not self._finished:  # the other turn still runs: the turn really passes
            hand_overs.append(self._holder)
        original(self)

    dist_moe.TakingTurns.hand_over = counted
    try:
        train(overlapped)
        (Path(overlapped.job.folder) / f"hand_overs{rank}.json").write_text(json.dumps(len(hand_overs)))
        dist_moe.TakingTurns.hand_over = original
        train(plain)
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.skipif(not V_ON_GLOO, reason="this torch's V schedules need NCCL")
def test_pp2_x_ep2_dualpipev_overlapped_is_plain_dualpipev_and_follows_one_process(tmp_path):
    overlapped = _job(tmp_path / "overlapped", **DUALPIPEV, **{"parallelism.pp_overlap_ep": "true"})
    # Steps 1-3 of the plain schedule: their losses and gradient norms follow from the warm-up's updates
    # only (lr_schedule.warmup_steps 2), which the run's length does not change.
    plain = _job(tmp_path / "plain", **DUALPIPEV, **{"training.steps": "3"})
    spawn_ranks(_overlapped_then_plain_rank, 4, (4, file_rendezvous(tmp_path), overlapped, plain))
    train(_job(tmp_path / "single", **{"parallelism.ep": "1", "parallelism.dp_shard": "-1"}))
    assert all(json.loads((tmp_path / "overlapped" / f"hand_overs{r}.json").read_text()) > 0 for r in range(4))
    overlapped_curve = _curve(tmp_path / "overlapped")
    assert {step: overlapped_curve[step] for step in (1, 2, 3)} == _curve(tmp_path / "plain")  # bitwise
    assert_pairs_follow(overlapped_curve, _curve(tmp_path / "single"), range(1, STEPS + 1))
