"""Rollouts (single- and multi-turn), the staleness bound of asynchronous rollouts, and the RL loop."""
from __future__ import annotations

import statistics
import time

import pytest
import titan_models as tm
import torch

from titan_rl import (
    AsyncRollouts, BuiltinGenerator, CharTokenizer, RLConfig, RLLoop, SamplingConfig, batch_invariant,
    collect_rollouts, dapo, grpo,
)
from titan_rl.envs import ArithmeticTask, SingleTurn, SortingTask, ToolEnv

TOK = CharTokenizer("0123456789sort:=\n")
TOOL_TOK = CharTokenizer("0123456789+-*/=:<>()abcdefghijklmnopqrstuvwxyzACDEFGHIJKLMNOPQRSTUVWXYZ,. \n")


def tiny_policy(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    config = tm.llama3.Llama3Config(vocab_size=vocab_size, dim=64, num_layers=2, num_heads=1, num_kv_heads=1,
                                    ffn_dim=192, max_seq_len=512)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def sorting_loop(*, max_policy_lag=0, algorithm=None, invariant=False, lr=3e-3, copy_model=False, seed=0):
    torch.manual_seed(seed)
    policy = tiny_policy(TOK.vocab_size, seed=seed)
    if invariant:
        batch_invariant(policy)
    newline = TOK.encode("\n")[0]
    return RLLoop(
        policy=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99)),
        generator=BuiltinGenerator(policy, copy_model=copy_model, pad_id=TOK.pad_id), tokenizer=TOK,
        make_env=lambda: SingleTurn(SortingTask(min_length=3, max_length=3)),
        config=RLConfig(algorithm=algorithm or grpo(group_size=8), prompts_per_step=8, max_policy_lag=max_policy_lag,
                        sampling=SamplingConfig(max_new_tokens=4, stop_token_ids=(newline,), seed=None), seed=seed),
    )


def test_grpo_improves_reward_on_sorting_from_scratch():
    loop = sorting_loop()
    rewards = [loop.step()["reward_mean"] for _ in range(45)]
    early, late = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    print(f"sorting reward: first 5 steps {early:.3f}, last 5 steps {late:.3f}")
    assert late > early + 0.15, rewards


def test_metrics_and_zero_mismatch_in_batch_invariant_mode():
    loop = sorting_loop(invariant=True, algorithm=grpo(group_size=4, kl_coef=0.01))
    for _ in range(2):
        m = loop.step()
    for key in ("reward_mean", "adv_mean", "adv_std", "kl", "logprob_mismatch_max", "logprob_mismatch_mean", "staleness",
                "dropped_samples", "gen_tokens_per_s", "train_tokens_per_s", "clip_frac", "tis_weight_mean"):
        assert key in m, key
    # Generator and trainer share the definition, the weights and the kernels: no mismatch at all.
    assert m["logprob_mismatch_max"] == 0.0 and m["tis_weight_mean"] == 1.0
    assert m["staleness"] == 0 and m["policy_version"] == 1 and m["kl"] > 0


def test_dapo_drops_uninformative_groups():
    loop = sorting_loop(algorithm=dapo(group_size=4))
    m = loop.step()
    assert m["trained_samples"] == 4 * (8 - m["filtered_groups"])


def test_async_rollouts_respect_the_staleness_bound():
    policy = tiny_policy(TOK.vocab_size)
    generator = BuiltinGenerator(policy, copy_model=True, pad_id=TOK.pad_id)
    produced = []

    def produce(first_group):
        batch = collect_rollouts(make_env=lambda: SingleTurn(SortingTask()), seeds=[first_group], group_size=2,
                                 generator=generator, tokenizer=TOK, sampling=SamplingConfig(max_new_tokens=3))
        produced.append((batch.policy_version, len(batch.samples)))
        return batch

    version = 0
    with AsyncRollouts(produce, max_policy_lag=1, groups_per_batch=1) as rollouts:
        for step in range(6):
            batch = rollouts.get(version)
            assert all(s.policy_version == batch.policy_version for s in batch.samples)
            assert version - batch.policy_version <= 1
            # Every other step the trainer jumps ahead 3 versions (several optimizer steps) once the
            # producer has queued its next batch, which thereby becomes too stale and must be dropped.
            if step % 2:
                deadline = time.monotonic() + 120
                while rollouts.queued() == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                version += 3
            else:
                version += 1
            generator.update_weights({}, version=version)
    lags = rollouts.stats.lags
    assert len(lags) == 6 and max(lags) <= 1
    assert rollouts.stats.dropped_batches >= 1
    assert rollouts.stats.dropped_samples == 2 * rollouts.stats.dropped_batches
    with pytest.raises(ValueError, match="max_policy_lag"):
        AsyncRollouts(produce, max_policy_lag=-1, groups_per_batch=1)


def test_loop_with_background_generation_trains_off_policy_within_the_bound():
    loop = sorting_loop(max_policy_lag=2, copy_model=True)
    try:
        metrics = [loop.step() for _ in range(5)]
    finally:
        loop.close()
    assert all(m["staleness"] <= 2 for m in metrics)
    assert loop.generator.policy_version == 5 and loop.generator.model is not loop.policy


def test_background_generation_needs_its_own_weights():
    with pytest.raises(ValueError, match="copy_model=True"):
        sorting_loop(max_policy_lag=1, copy_model=False)


def test_multi_turn_rollout_masks_environment_tokens():
    policy = tiny_policy(TOOL_TOK.vocab_size)
    gen = BuiltinGenerator(policy, pad_id=TOOL_TOK.pad_id)
    batch = collect_rollouts(make_env=lambda: ToolEnv(ArithmeticTask(max_operand=9), max_turns=3), seeds=[0, 1],
                             group_size=2, generator=gen, tokenizer=TOOL_TOK,
                             sampling=SamplingConfig(max_new_tokens=6, seed=0), max_turns=3)
    assert len(batch.samples) == 4 and {s.group for s in batch.samples} == {0, 1}
    for s in batch.samples:
        assert s.turns == 3  # an untrained model never answers: every episode uses all turns
        env_positions = [i for i, m in enumerate(s.loss_mask) if m == 0]
        assert env_positions, "the environment's <result> observations are in the completion"
        assert all(s.behavior_logprobs[i] == 0 for i in env_positions)
        assert "<result>" in s.text and s.reward == 0.0


def test_loop_trains_on_multi_turn_episodes_with_masked_observations():
    policy = tiny_policy(TOOL_TOK.vocab_size)
    stops = tuple(tuple(TOOL_TOK.encode(s)) for s in ("</tool>", "</answer>"))
    loop = RLLoop(policy=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0),
                  generator=BuiltinGenerator(policy, pad_id=TOOL_TOK.pad_id), tokenizer=TOOL_TOK,
                  make_env=lambda: ToolEnv(ArithmeticTask(max_operand=9), max_turns=2),
                  config=RLConfig(algorithm=grpo(group_size=2), prompts_per_step=2, max_turns=2,
                                  sampling=SamplingConfig(max_new_tokens=6, stop_sequences=stops, seed=0)))
    before = [p.detach().clone() for p in policy.parameters()]
    m = loop.step()
    assert m["trained_samples"] == 4 and m["completion_len"] > 12  # two turns plus an observation
    # All rewards are 0 (an untrained model never answers), so the advantages and the update are zero.
    assert m["reward_mean"] == 0.0 and m["adv_abs_max"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
