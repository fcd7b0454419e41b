"""`titan-train rl --generator.ranks 2` on 4 gloo ranks: ranks 0-1 train (FSDP over their own group), ranks 2-3
generate (each its own built-in generator, in its own process), rollouts streamed to the trainer and the
weights broadcast back after every update (titan_rl.weight_sync / remote_rollouts).

- batch-invariant and on-policy: the trainer's logprobs of every sampled token are bitwise what the
  generator ranks reported, at every step, for a dense (Llama) and a MoE (Qwen3-MoE) policy; that holds
  only if the generators hold the trainer's weights exactly (the weights themselves are compared bitwise in
  titan-rl's tests/test_disaggregated.py).
- max_policy_lag 1, DAPO (whose dynamic sampling takes further batches at the same version): every consumed
  batch is at most one version old, and the step time is split into rollout, training and weight-sync
  seconds in rl_metrics.jsonl.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks
from titan_train_rl_ranks import records as metrics_records
from titan_train_rl_ranks import small_job

from titan_train.rl import run_rl
from titan_train.rl.build import validate

STEPS = 3


def _rank_main(rank: int, world: int, init_method: str, folder: str) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, init_method)
    try:
        common = dict(pretrain__steps=0, training__steps=STEPS, eval__problems=4, rollout__prompts_per_step=4,
                      algorithm__group_size=2, rollout__max_new_tokens=4, generator__batch_invariant=True,
                      generator__ranks=2)
        # pretraining runs on all 4 ranks, before the split (once: it is titan-train's trainer, tested elsewhere)
        run_rl(small_job(Path(folder, "sync"), **common | dict(pretrain__steps=2, pretrain__batch_size=4)))
        # DAPO from untrained weights: every group scores 0, so each step refills (GRANT messages)
        run_rl(small_job(Path(folder, "async"), **common, rollout__max_policy_lag=1, algorithm__name="dapo"))
        run_rl(small_job(Path(folder, "moe"), **common, policy__family="qwen3", policy__flavor="debug_moe",
                          policy__num_layers=1))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # torch sometimes aborts at interpreter exit after gloo


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl_disaggregated")
    spawn_ranks(_rank_main, 4, (4, file_rendezvous(folder), str(folder)))
    return folder


@pytest.mark.parametrize("run", ["sync", "moe"])
def test_trainer_and_generator_ranks_agree_bitwise(four_ranks, run):
    records = metrics_records(four_ranks / run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["logprob_mismatch_max"] for r in records] == [0.0] * STEPS
    assert all(r["trained_samples"] == 8 and r["staleness"] == 0 for r in records)
    summary = json.loads((four_ranks / run / "rl_summary.json").read_text())
    assert sorted(summary["eval_reward"]) == ["0", str(STEPS)]  # the trainer ranks evaluated on their own copy
    if run == "sync":
        pretrain = [json.loads(line) for line in (four_ranks / run / "pretrain" / "metrics.jsonl").open()]
        assert pretrain[-1]["step"] == 2


def test_disaggregated_async_keeps_the_staleness_bound_and_splits_the_step_time(four_ranks):
    records = metrics_records(four_ranks / "async")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(0 <= r["staleness"] <= 1 for r in records)
    assert sum(r["refills"] for r in records) > 0  # batches taken without a weight update (granted) came
    for r in records:
        parts = r["rollout_seconds"] + r["train_seconds"] + r["weight_sync_seconds"]
        assert all(r[k] > 0 for k in ("rollout_seconds", "train_seconds", "weight_sync_seconds", "generation_seconds"))
        assert parts <= r["step_seconds"] + 1e-6, r


def test_generator_ranks_are_checked_against_the_world():
    with pytest.raises(ValueError, match="generator.ranks"):
        validate(small_job(Path("unused"), generator__ranks=2), world_size=2)  # nobody left to train
    with pytest.raises(ValueError, match="generator ranks"):
        validate(small_job(Path("unused"), generator__ranks=3, rollout__prompts_per_step=4), world_size=4)
    fits = small_job(Path("unused"), generator__ranks=2, rollout__prompts_per_step=4, pretrain__steps=0)
    validate(fits, world_size=3)  # 1 trainer + 2 generators, 2 prompts each
