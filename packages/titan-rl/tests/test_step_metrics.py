"""Every stability metric of an RL step, against an independent computation on a small batch: reward, KL to
the reference, entropy and clip fraction recomputed in float64 one sequence at a time from snapshots of the
weights; the trainer/generator logprob mismatch from offsets the generator adds on purpose; staleness and
dropped samples from scripted batches; generation and training tokens/s from counted tokens on a fake clock."""
from __future__ import annotations

import copy
import types

import pytest
import titan_models as tm
import torch

from titan_rl import BuiltinGenerator, CharTokenizer, Completion, RLConfig, RLLoop, SamplingConfig, grpo
from titan_rl.envs import SingleTurn
from titan_rl.envs.base import Problem, first_line
from titan_rl.rollout import RolloutBatch, StalenessStats, collect_rollouts

TOK = CharTokenizer("0123456789sort:=\n")
NEWLINE = TOK.encode("\n")[0]


class LengthTask:
    """Reward = the answer's length / 4: random text gets varied rewards, so advantages are not zero."""

    def sample(self, rng):
        return Problem(prompt=f"sort:{rng.randint(100, 999)}=", answer="")

    def reward(self, problem, completion):
        return len(first_line(completion)) / 4


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    config = tm.llama3.Llama3Config(vocab_size=TOK.vocab_size, dim=64, num_layers=2, num_heads=1, num_kv_heads=1,
                                    ffn_dim=192, max_seq_len=128)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def offset(j: int) -> float:
    """What the generator subtracts from its j-th token's logprob: the mismatch the trainer must report."""
    return 0.01 * (j + 1)


class OffsetGenerator:
    """A BuiltinGenerator whose reported logprobs are lowered by `offset(j)` (a known mismatch)."""

    def __init__(self, inner: BuiltinGenerator) -> None:
        self.inner = inner

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompts, sampling):
        outs = self.inner.generate(prompts, sampling)
        return [Completion(prompt=o.prompt, tokens=o.tokens, finish_reason=o.finish_reason,
                           policy_version=o.policy_version,
                           logprobs=o.logprobs - torch.tensor([offset(j) for j in range(len(o.tokens))]))
                for o in outs]

    def update_weights(self, state_dict, *, version):
        self.inner.update_weights(state_dict, version=version)


def make_loop(*, minibatches: int = 2, lr: float = 3e-2) -> RLLoop:
    torch.manual_seed(0)
    policy = tiny_policy()
    generator = OffsetGenerator(BuiltinGenerator(policy, copy_model=True, pad_id=TOK.pad_id))
    return RLLoop(policy=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=lr), generator=generator,
                  tokenizer=TOK, make_env=lambda: SingleTurn(LengthTask()),
                  config=RLConfig(algorithm=grpo(group_size=4), prompts_per_step=2, minibatches=minibatches,
                                  sampling=SamplingConfig(max_new_tokens=5, stop_token_ids=(NEWLINE,), seed=3)))


def _logprobs_and_entropy64(state: dict[str, torch.Tensor], sample) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, one unpadded sequence: log p and entropy at each completion token of `sample`."""
    model = tiny_policy()
    model.load_state_dict(state)
    model = model.double()
    tokens = torch.tensor([sample.prompt + sample.completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens)[0].double(), dim=-1)
    p, c = len(sample.prompt), len(sample.completion)
    rows = logp[p - 1:p - 1 + c]
    return rows.gather(1, tokens[0, p:p + c, None])[:, 0], -(rows.exp() * rows).sum(-1)


def test_reward_kl_entropy_clip_and_mismatch_match_an_independent_computation():
    loop = make_loop()
    batches, states = [], []
    produce = loop.rollouts.produce
    loop.rollouts.produce = lambda first: batches.append(produce(first)) or batches[-1]
    step = loop.optimizer.step
    loop.optimizer.step = lambda *a, **k: (step(*a, **k), states.append(copy.deepcopy(loop.policy.state_dict())))[0]
    start = copy.deepcopy(loop.policy.state_dict())
    reference = copy.deepcopy(loop.reference.state_dict())
    m = loop.step()

    samples = batches[0].samples
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    assert m["reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-12)
    groups = rewards.view(2, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).flatten()
    assert bool((advantages != 0).any()), "the check needs a learning signal"

    # Minibatch 1 (samples 0-3) trains from the start weights, minibatch 2 (4-7) from those after one step;
    # the PPO "old" policy and the reference are the start weights.
    kl, entropy, clip, ambiguous = [], [], [], 0
    for part, weights in ((range(0, 4), start), (range(4, 8), states[0])):
        k3s, entropies, clipped = [], [], []
        for i in part:
            logp, ent = _logprobs_and_entropy64(weights, samples[i])
            old, _ = _logprobs_and_entropy64(start, samples[i])
            ref, _ = _logprobs_and_entropy64(reference, samples[i])
            delta = ref - logp
            k3s.append(delta.exp() - delta - 1)
            entropies.append(ent)
            ratio = (logp - old).exp()
            a = float(advantages[i])
            clipped.append(((ratio < 0.8) & (a < 0)) | ((ratio > 1.2) & (a > 0)))
            ambiguous += int(((ratio - 0.8).abs() < 1e-4).sum() + ((ratio - 1.2).abs() < 1e-4).sum())
        kl.append(float(torch.cat(k3s).mean()))
        entropy.append(float(torch.cat(entropies).mean()))
        clip.append(float(torch.cat(clipped).double().mean()))
    tokens = sum(len(s.completion) for s in samples)
    assert kl[0] < 1e-10 < kl[1] and clip[1] > 0  # the second minibatch moved: KL and clipping are measured
    assert m["kl"] == pytest.approx(sum(kl) / 2, rel=1e-4)
    assert m["entropy"] == pytest.approx(sum(entropy) / 2, rel=1e-5)
    assert abs(m["clip_frac"] - sum(clip) / 2) <= ambiguous / tokens + 1e-6  # float32 means
    # The generator reported logprobs lowered by offset(j): the trainer's mismatch is that, up to float32 rounding.
    offsets = torch.tensor([offset(j) for s in samples for j in range(len(s.completion))])
    assert m["logprob_mismatch_max"] == pytest.approx(float(offsets.max()), abs=1e-5)
    assert m["logprob_mismatch_mean"] == pytest.approx(float(offsets.mean()), abs=1e-5)


def test_kl_is_reported_without_a_kl_term_and_entropy_without_the_mode():
    loop = make_loop(minibatches=1)
    assert loop.config.algorithm.loss.kl_coef == 0 and loop.reference is not None  # track_kl's default
    first, second = loop.step(), loop.step()
    assert first["kl"] == 0.0 < second["kl"]  # the reference is the policy as it started
    assert second["entropy"] > 0
    without = RLLoop(policy=tiny_policy(), optimizer=torch.optim.SGD(tiny_policy().parameters(), lr=0.0),
                     generator=BuiltinGenerator(tiny_policy(), pad_id=TOK.pad_id), tokenizer=TOK,
                     make_env=lambda: SingleTurn(LengthTask()), config=RLConfig(track_kl=False))
    assert without.reference is None


class ScriptedRollouts:
    """Hands out prepared batches and a dropped-samples count as AsyncRollouts would."""

    def __init__(self, script: list[tuple[RolloutBatch, int]]) -> None:
        self.script, self.stats = list(script), StalenessStats()

    def get(self, trainer_version: int) -> RolloutBatch:
        batch, dropped = self.script.pop(0)
        self.stats.dropped_samples += dropped
        return batch

    def close(self) -> None:
        pass


def test_staleness_dropped_samples_and_throughputs_match_counted_values(monkeypatch):
    loop = make_loop(minibatches=1)
    generator = loop.generator

    def batch_at(version: int, first_group: int) -> RolloutBatch:
        generator.inner.policy_version = version  # as if produced from weights of that version
        return collect_rollouts(make_env=lambda: SingleTurn(LengthTask()), seeds=[first_group, first_group + 1],
                                group_size=4, generator=generator, tokenizer=TOK, sampling=loop.sampling,
                                first_group=first_group)

    clock = types.SimpleNamespace(now=0.0)

    def perf_counter() -> float:  # every reading is 0.25 s after the previous one
        clock.now += 0.25
        return clock.now

    for module in ("titan_rl.loop", "titan_rl.rollout"):
        monkeypatch.setattr(f"{module}.time", types.SimpleNamespace(perf_counter=perf_counter))
    script = [(batch_at(0, 0), 0), (batch_at(0, 2), 8), (batch_at(0, 4), 0)]
    generator.inner.policy_version = 0
    loop.rollouts = ScriptedRollouts(script)
    expected = [(0, 0), (1, 8), (2, 0)]  # (trainer version - the batch's, samples dropped since the last step)
    for (batch, _), (staleness, dropped) in zip(list(script), expected):
        m = loop.step()
        assert (m["staleness"], m["dropped_samples"]) == (staleness, dropped)
        generated = sum(len(s.completion) for s in batch.samples)
        assert m["gen_tokens_per_s"] == pytest.approx(generated / 0.25, rel=1e-12)
        padded = len(batch.samples) * max(len(s.prompt) + len(s.completion) for s in batch.samples)
        assert m["train_tokens_per_s"] == pytest.approx(padded / 0.25, rel=1e-12)  # one clock reading apart
    assert m["dropped_samples_total"] == 8
