"""The RL job end to end: pretraining by titan-train's trainer, then GRPO improving the reward, with the
curve and metrics saved; on 2 gloo ranks (FSDP policy, a generator per rank fed by export_weights)."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks

from titan_rl import Completion, SamplingConfig
from titan_rl.envs import SingleTurn, SortingTask
from titan_train.rl import RLConfig, run_rl
from titan_train.rl.recipes import rl_sorting_deepseek_v3, rl_sorting_qwen3_moe
from titan_train.rl.rollouts import SEED_STRIDE, ShardedRollouts

REQUIRED_METRICS = ("step", "reward_mean", "kl", "entropy", "clip_frac", "staleness", "dropped_samples",
                    "dropped_samples_total", "logprob_mismatch_max", "gen_tokens_per_s", "train_tokens_per_s", "loss",
                    "completion_len")


def small_job(folder: Path, **changes) -> RLConfig:
    config = RLConfig()
    config.job.folder = str(folder)
    config.job.device = "cpu"  # gloo ranks of a CPU test; "auto" put both ranks on one GPU of the H200 host
    config.metrics.progress = False
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        setattr(getattr(config, section), name, value)
    return config


def test_short_rl_run_improves_reward_and_saves_the_curve(tmp_path):
    """20 supervised steps teach the format (greedy reward ~0.2-0.35 on held-out problems); 40 GRPO steps
    raise it. On the CPU (job.device=cpu: with "auto" the 16-core GPU host ran this on CUDA, another
    trajectory, and its held-out gain was 0.31 -> 0.32) and one thread (job.threads, the default).
    With the former lr 1e-3 and 64 held-out problems, seeds 4 and 6 lowered the held-out reward
    (-0.07, -0.03): the margin held for the seeds it was tuned on only. With lr 3e-4 and 128 problems,
    seeds 0, 1, 2, 4, 6: sampled reward +0.056..+0.18 (first vs last 10 steps), held-out greedy reward
    +0.008..+0.19; the thresholds sit under the weakest of those."""
    config = small_job(tmp_path, pretrain__steps=20, training__steps=40, training__lr=3e-4, eval__problems=128,
                       eval__interval=20, job__device="cpu")
    result = run_rl(config)

    losses = result.pretrain_losses
    assert sorted(losses) == list(range(1, 21)) and losses[20] < losses[1] - 2, losses  # the trainer learned the format
    assert (tmp_path / "pretrain" / "metrics.jsonl").exists() and (tmp_path / "pretrain" / "data.jsonl").exists()

    rewards = [m["reward_mean"] for m in result.curve]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.04, (first, last, rewards)
    assert sorted(result.evals) == [0, 20, 40]
    assert result.evals[40] > result.evals[0], result.evals

    records = [json.loads(line) for line in (tmp_path / "rl_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for key in REQUIRED_METRICS:
        assert all(key in r for r in records), key
    assert all(r["staleness"] == 0 and r["dropped_samples_total"] == 0 for r in records)  # synchronous
    assert max(r["logprob_mismatch_max"] for r in records) < 1e-4  # generator and trainer: same weights each step
    with open(tmp_path / "rl_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 41))
    assert float(rows[-1]["eval_reward"]) == pytest.approx(result.evals[40]) and rows[0]["eval_reward"] == ""
    summary = json.loads((tmp_path / "rl_summary.json").read_text())
    assert summary["reward_last_steps"] == pytest.approx(last) and summary["eval_reward"]["0"] == result.evals[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is the test above)")
def test_rl_job_on_gpu_batch_invariant(tmp_path):
    """On a GPU: bf16 pretraining, then RL with titan-rl's Triton batch-invariant kernels in trainer and
    generator, whose logprobs must agree bitwise at every (on-policy) step; the reward still improves."""
    config = small_job(tmp_path, pretrain__steps=20, training__steps=40, training__lr=1e-3, eval__problems=64,
                       eval__interval=0, generator__batch_invariant=True)
    config.job.device = "cuda"
    result = run_rl(config)
    assert [m["logprob_mismatch_max"] for m in result.curve] == [0.0] * 40
    rewards = [m["reward_mean"] for m in result.curve]
    assert sum(rewards[-10:]) > sum(rewards[:10]) + 0.5, rewards  # +0.05 per step on average, as on CPU


class InstantGenerator:
    """Answers every prompt with EOS at once (rollout bookkeeping without a model)."""

    policy_version = 0

    def generate(self, prompts, sampling):
        return [Completion(prompt=p, tokens=[257], logprobs=torch.zeros(1), finish_reason="stop",
                           policy_version=self.policy_version) for p in prompts]

    def update_weights(self, state_dict, *, version):
        self.policy_version = version


def _rank_main(rank: int, world: int, init_method: str, folder: str) -> None:
    import torch.distributed as dist

    from titan_rl import ByteTokenizer

    join_gloo(rank, world, init_method)
    try:
        # Ranks that hold different batches (one dropped a batch the other kept) agree on the later one.
        task = SortingTask(min_length=3, max_length=3)
        rollouts = ShardedRollouts(make_env=lambda: SingleTurn(task), generator=InstantGenerator(),
                                   tokenizer=ByteTokenizer(), sampling=SamplingConfig(max_new_tokens=2),
                                   group_size=2, groups_per_step=4, max_policy_lag=0, seed=5)
        if rank == 1:
            rollouts.local.get(0)  # rank 1 is now a batch ahead
        batch = rollouts.get(0)
        if rank == 0:
            prompts = [s.prompt for s in batch.samples]
            Path(folder, "agreement.json").write_text(json.dumps({
                "groups": [s.group for s in batch.samples], "dropped": batch.dropped_samples,
                "prompts_match": prompts == [ByteTokenizer().encode(SingleTurn(task).reset(seed=5 * SEED_STRIDE + g))
                                             for g in range(4, 8) for _ in range(2)]}))
        # The whole job: FSDP pretraining and RL, batch-invariant, synchronous; then asynchronous (lag 1).
        common = dict(pretrain__steps=4, training__steps=3, eval__problems=8, rollout__prompts_per_step=4,
                      algorithm__group_size=4, generator__batch_invariant=True)
        run_rl(small_job(Path(folder, "sync"), **common))
        run_rl(small_job(Path(folder, "async"), **common, rollout__max_policy_lag=1))
        # A MoE policy (DeepSeek-V3's debug flavor: group-limited routing) under FSDP, batch-invariant.
        moe = small_job(Path(folder, "moe"), **common)
        moe.policy = rl_sorting_deepseek_v3().policy
        run_rl(moe)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # torch sometimes aborts at interpreter exit after gloo


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl_ranks")
    init_method = file_rendezvous(folder)
    spawn_ranks(_rank_main, 2, (2, init_method, str(folder)))
    return folder


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rl_metrics.jsonl").read_text().splitlines()]


def test_ranks_agree_on_one_global_batch(two_ranks):
    agreement = json.loads((two_ranks / "agreement.json").read_text())
    assert agreement["groups"] == [4, 4, 5, 5, 6, 6, 7, 7]  # batch 1 of both ranks, in group order
    assert agreement["dropped"] == 4  # rank 0's share of batch 0 (2 groups x 2 samples), skipped
    assert agreement["prompts_match"]  # group g's problem comes from seed * stride + g, whatever the rank


def test_two_rank_job_trainer_and_generators_agree_bitwise(two_ranks):
    """Batch-invariant and on-policy: the FSDP trainer's logprobs of every sampled token are bitwise the
    logprobs each rank's generator reported, at every step, so the full weights reach the generators."""
    records = _records(two_ranks / "sync")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["logprob_mismatch_max"] for r in records] == [0.0, 0.0, 0.0]
    assert all(r["trained_samples"] == 16 and r["staleness"] == 0 for r in records)
    pretrain = [json.loads(line) for line in (two_ranks / "sync" / "pretrain" / "metrics.jsonl").open()]
    assert pretrain[-1]["step"] == 4  # titan-train's trainer ran the supervised phase on the 2 ranks


def test_two_rank_moe_job_trainer_and_generators_agree_bitwise(two_ranks):
    """DeepSeek-V3's debug policy sharded over 2 ranks: every sampled token's trainer logprob is bitwise its
    generator's (same expert choice and arithmetic in prefill, decode and the trainer's forward)."""
    records = _records(two_ranks / "moe")
    assert [r["logprob_mismatch_max"] for r in records] == [0.0, 0.0, 0.0]
    assert all(r["trained_samples"] == 16 for r in records)


@pytest.mark.parametrize("recipe", [rl_sorting_qwen3_moe, rl_sorting_deepseek_v3])
def test_moe_recipes_run_batch_invariant(tmp_path, recipe):
    """The MoE recipes, shortened: pretraining and RL run on the MoE policy and the logprobs agree bitwise."""
    config = recipe()
    assert config.generator.batch_invariant and config.policy.family in ("qwen3", "deepseek_v3")
    config.job.folder, config.metrics.progress = str(tmp_path), False
    config.pretrain.steps, config.training.steps, config.eval.problems = 3, 2, 8
    config.rollout.prompts_per_step, config.algorithm.group_size = 4, 4
    result = run_rl(config)
    assert [m["logprob_mismatch_max"] for m in result.curve] == [0.0, 0.0]
    assert all(m["entropy"] > 0 for m in result.curve) and (tmp_path / "rl_curve.png").exists()


def test_two_rank_async_job_keeps_the_staleness_bound(two_ranks):
    records = _records(two_ranks / "async")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness"] <= 1 for r in records)
    assert all(r["trained_samples"] == 16 for r in records)


def test_tied_embedding_policy_keeps_its_generator_tied_and_bitwise(tmp_path, monkeypatch):
    """A policy whose output projection is its embedding (Llama 3's debug_tied flavor, tied as 1B and 3B are):
    the exported weights name the matrix twice, and after every update the generator holds them bitwise,
    still tied; batch-invariant, its logprobs of every sampled token are then bitwise the trainer's."""
    import titan_rl

    synced = []
    update = titan_rl.BuiltinGenerator.update_weights

    def recorded_update(self, state_dict, *, version):
        update(self, state_dict, version=version)
        held = self.model.state_dict()
        synced.append((version, self.model.output.weight is self.model.tok_embeddings.weight, sorted(held) ==
                       sorted(state_dict) and all(torch.equal(held[k], state_dict[k]) for k in state_dict)))

    monkeypatch.setattr(titan_rl.BuiltinGenerator, "update_weights", recorded_update)
    config = small_job(tmp_path, policy__flavor="debug_tied", policy__num_layers=1, pretrain__steps=2,
                       training__steps=2, eval__problems=0, rollout__prompts_per_step=2, algorithm__group_size=4,
                       generator__batch_invariant=True)
    result = run_rl(config)
    assert synced == [(1, True, True), (2, True, True)]
    assert [m["logprob_mismatch_max"] for m in result.curve] == [0.0, 0.0]
    assert all(m["trained_samples"] == 8 for m in result.curve)
