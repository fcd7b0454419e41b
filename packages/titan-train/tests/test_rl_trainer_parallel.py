"""The RL trainer split over its ranks with disaggregated generation, on 3 gloo ranks (2 trainer + 1 generator):

- training.tensor_parallel 2 (FSDP1 x TP2, titan-train's TP plan on the trainer ranks only);
- training.context_parallel 2 (the rl_long_context recipe: ring attention over the 2 trainer ranks).

After every update the generator rank's whole (TP1) model equals the trainer's full weights bitwise
(gathered over its TP shards or FSDP shards by torch's get_model_state_dict, a gather other than the sync's),
and the weights change each update (so a stale sync would show). The runs' gradient norms, entropies and
KLs follow the one-process colocated run of the same job (titan_train_curves' tolerances; the on-policy
GRPO loss is ~0 and compared absolutely): one generator rank samples
as the one process does (the same seed, the same prompts), so both see the same rollouts while the weights
agree to rounding, and what differs is the trainer's split alone.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from titan_train_curves import tolerance
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks
from titan_train_rl_ranks import load_weights, recording_weights, records, small_job

from titan_train.model_setup import build_on_meta, model_config
from titan_train.rl import run_rl
from titan_train.rl.build import check_tensor_parallel, validate
from titan_train.rl.pretrain import policy_model_config
from titan_train.rl.recipes import RL_RECIPES

STEPS = 3
# a few pretraining steps (on all ranks, before the split): from random weights every reward is 0, and so
# is every gradient; after them some groups' rewards differ
PRETRAIN = dict(pretrain__steps=8, pretrain__batch_size=6, pretrain__warmup_steps=2)
TP_JOB = dict(PRETRAIN, training__steps=STEPS, eval__problems=0, rollout__prompts_per_step=2,
              algorithm__group_size=4, rollout__max_new_tokens=6, training__lr=3e-3)


def long_context_job(folder, **changes):
    config = RL_RECIPES["rl_long_context"]()
    config.job.folder, config.metrics.progress = str(folder), False
    config.env.context_chars, config.training.steps, config.eval.problems = 256, STEPS, 0
    config.training.lr, config.pretrain.seq_len = 3e-3, 384
    for dotted, value in (PRETRAIN | changes).items():
        section, name = dotted.split("__")
        setattr(getattr(config, section), name, value)
    return config


def _rank_main(rank: int, world: int, init_method: str, folder: str, run: str) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, init_method)
    try:
        with recording_weights(folder, generator_ranks=1):
            run_rl(small_job(folder, **TP_JOB, generator__ranks=1, training__tensor_parallel=2) if run == "tp"
                   else long_context_job(folder, generator__ranks=1))
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """run -> its folder, each run on 3 ranks of its own, spawned on first use: in one spawn a failed tp run
    showed as a cp failure too (its trainer ranks died; the generator rank, stopped by the trainer's cleanup,
    went on to cp's pretraining barrier: "Connection closed by peer")."""
    folder = tmp_path_factory.mktemp("rl_trainer_parallel")
    outcomes: dict[str, Path | BaseException] = {}

    def get(run: str) -> Path:
        if run not in outcomes:
            (folder / run).mkdir()
            try:
                spawn_ranks(_rank_main, 3, (3, file_rendezvous(folder / run), str(folder / run), run))
                outcomes[run] = folder / run
            except Exception as error:  # kept, and raised again for each test of the run
                outcomes[run] = error
        if isinstance(outcomes[run], BaseException):
            raise outcomes[run]
        return outcomes[run]
    return get


def _curve(folder) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in records(folder)}


@pytest.mark.parametrize("run", ["tp", "cp"])
def test_generator_holds_the_trainers_full_weights_bitwise_after_every_update(split_runs, run):
    trainer, generator = load_weights(split_runs(run), 0), load_weights(split_runs(run), 2)
    assert sorted(generator) == list(range(STEPS + 1)) and sorted(trainer) == list(range(STEPS + 1))
    for version in range(STEPS + 1):
        assert generator[version] == trainer[version], f"version {version}"
    assert all(generator[v] != generator[v + 1] for v in range(STEPS)), "every update changes the weights"


@pytest.mark.parametrize("run", ["tp", "cp"])
def test_split_trainers_logprobs_match_the_generators(split_runs, run):
    """The trainer's split forward (TP shards, or the CP ring) scores every sampled token as the generator's
    whole model with its KV cache did, to float rounding (not batch-invariant: fp32, different kernels)."""
    got = records(split_runs(run))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert all(r["trained_samples"] == 8 and r["staleness"] == 0 for r in got)
    assert max(r["logprob_mismatch_max"] for r in got) < 1e-4, got


@pytest.mark.parametrize("run", ["tp", "cp"])
def test_split_trainer_follows_the_one_process_run(split_runs, tmp_path, run):
    run_rl(small_job(tmp_path, **TP_JOB) if run == "tp" else long_context_job(tmp_path, training__context_parallel=1))
    got, want = _curve(split_runs(run)), _curve(tmp_path)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["reward_mean"] == want[step]["reward_mean"], step  # the same rollouts
        for name in ("grad_norm", "kl"):
            assert got[step][name] == pytest.approx(want[step][name], rel=tolerance(step), abs=1e-7), (step, name)
        # entropy in nats, at the scale of the first step's: a policy that has collapsed (torch 2.11's run: 0.021
        # nats at step 3, from 2.5) turns the split's rounding (7.5e-8 relative in step 1's gradient norm) into
        # 3.8e-4 relative entropy (8e-6 nats), the sensitivity of a near-deterministic distribution's entropy
        entropy_scale = want[1]["entropy"]
        assert got[step]["entropy"] == pytest.approx(want[step]["entropy"], rel=tolerance(step),
                                                     abs=tolerance(step) * entropy_scale), (step, "entropy")
        # on-policy GRPO's loss is a sum of normalised advantages, ~0 up to rounding: compared absolutely
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6), step
    assert max(r["grad_norm"] for r in want.values()) > 0.1, "some step should train (else nothing is compared)"


def test_trainer_splits_that_do_not_compose_are_refused():
    with pytest.raises(ValueError, match="training.tensor_parallel=2 must divide"):
        validate(small_job("unused", **TP_JOB, generator__ranks=2, training__tensor_parallel=2), world_size=3)
    with pytest.raises(ValueError, match="batch-invariant"):
        validate(small_job("unused", **TP_JOB, training__tensor_parallel=2, generator__batch_invariant=True),
                 world_size=2)
    with pytest.raises(ValueError, match="not supported yet"):
        both = TP_JOB | dict(rollout__prompts_per_step=4, pretrain__steps=0)
        validate(small_job("unused", **both, training__tensor_parallel=2, training__context_parallel=2), world_size=4)
    validate(long_context_job("unused", generator__ranks=1), world_size=3)  # CP2 trainers + a generator


@pytest.mark.parametrize(("family", "flavor", "vocab_size", "message"), [
    ("qwen3", "debug_moe", 384, "MoE policy"),       # the TP plan leaves routed experts to expert parallelism
    ("llama3", "1B", 384, "tied embeddings"),
    ("llama3", "debug", 385, "vocab_size=385"),
])
def test_policies_tensor_parallelism_cannot_split_are_refused(family, flavor, vocab_size, message):
    config = small_job("unused", policy__family=family, policy__flavor=flavor, policy__num_layers=1,
                       policy__vocab_size=vocab_size)
    model = build_on_meta(model_config(policy_model_config(config), vocab_needed=259))
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(model, 2)
    check_tensor_parallel(model, 1)
