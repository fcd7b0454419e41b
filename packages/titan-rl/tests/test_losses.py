"""The GRPO-family losses against a float64 reference written token by token with Python floats."""
from __future__ import annotations

import math

import pytest
import torch

from titan_rl import PolicyLossConfig, dapo, grpo, gspo, group_advantages, informative_groups, policy_loss


def reference_loss(cfg: PolicyLossConfig, logp, old, behav, ref, adv, lengths) -> float:
    """Plain-Python restatement of the objective (lists of floats, one sequence at a time)."""
    seq_losses, all_tokens = [], []
    for i, n in enumerate(lengths):
        lp, od = logp[i][:n], old[i][:n]
        if cfg.ratio_level == "sequence":
            r = math.exp(sum(a - b for a, b in zip(lp, od)) / n)
            ratios = [r] * n
        else:
            ratios = [math.exp(a - b) for a, b in zip(lp, od)]
        if behav is not None and cfg.tis_cap is not None:
            if cfg.ratio_level == "sequence":
                w = min(math.exp(sum(od[t] - behav[i][t] for t in range(n)) / n), cfg.tis_cap)
                weights = [w] * n
            else:
                weights = [min(math.exp(od[t] - behav[i][t]), cfg.tis_cap) for t in range(n)]
        else:
            weights = [1.0] * n
        terms = []
        for t in range(n):
            r = ratios[t]
            rc = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            term = -min(r * adv[i], rc * adv[i]) * weights[t]
            if cfg.kl_coef:
                d = ref[i][t] - lp[t]
                term += cfg.kl_coef * (math.exp(d) - d - 1)
            terms.append(term)
        seq_losses.append(sum(terms) / n)
        all_tokens.extend(terms)
    if cfg.aggregation == "token_mean":
        return sum(all_tokens) / len(all_tokens)
    return sum(seq_losses) / len(seq_losses)


CONFIGS = {
    "grpo": grpo().loss,
    "grpo_kl_tis": PolicyLossConfig(kl_coef=0.05, tis_cap=1.5),
    "dapo": dapo().loss,
    "gspo": PolicyLossConfig(ratio_level="sequence", clip_low=0.05, clip_high=0.08, tis_cap=1.2),
    "gspo_preset": gspo().loss,
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_matches_float64_reference(name):
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(sorted(CONFIGS).index(name))
    B, T = 6, 9
    lengths = [9, 1, 5, 7, 3, 8]
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # Spread the current policy well past the clip range in both directions.
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4).requires_grad_()
    behav = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # Garbage in the padding must not leak into the loss.
    logp_padded = torch.where(mask.bool(), logp, torch.full_like(logp, 1e4))
    out = policy_loss(cfg, logprobs=logp_padded, advantages=adv, mask=mask, old_logprobs=old,
                      behavior_logprobs=behav, ref_logprobs=ref if cfg.kl_coef else None)
    expected = reference_loss(cfg, logp.tolist(), old.tolist(), behav.tolist(), ref.tolist(), adv.tolist(), lengths)
    assert out.loss.dtype == torch.float64
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    # The gradient matches a finite difference of the reference at one token with an unclipped ratio.
    out.loss.backward()
    i, t = 0, 2
    h = 1e-6
    bumped = logp.detach().clone()
    bumped[i, t] += h
    up = reference_loss(cfg, bumped.tolist(), old.tolist(), behav.tolist(), ref.tolist(), adv.tolist(), lengths)
    bumped[i, t] -= 2 * h
    down = reference_loss(cfg, bumped.tolist(), old.tolist(), behav.tolist(), ref.tolist(), adv.tolist(), lengths)
    assert logp.grad[i, t].item() == pytest.approx((up - down) / (2 * h), rel=1e-5, abs=1e-9)
    assert torch.all(logp.grad[~mask.bool()] == 0)


def test_on_policy_without_old_logprobs_is_the_policy_gradient():
    # old == current (detached): ratio 1, no clipping, gradient = -A * grad logp / n per sequence.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(grpo().loss, logprobs=logp, advantages=torch.tensor([2.0], dtype=torch.float64),
                      mask=torch.ones(1, 3))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.0)
    assert torch.allclose(logp.grad, torch.full((1, 3), -2.0 / 3, dtype=torch.float64))
    assert out.metrics["clip_frac"] == 0.0


def test_clipping_zeroes_the_gradient_past_the_bound():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5]], dtype=torch.float64)).requires_grad_()
    out = policy_loss(PolicyLossConfig(clip_low=0.2, clip_high=0.28), logprobs=logp, old_logprobs=old,
                      advantages=torch.tensor([1.0], dtype=torch.float64), mask=torch.ones(1, 2))
    out.loss.backward()
    # token 0: ratio 1.5 > 1.28 with A > 0 -> clipped (no gradient); token 1: ratio 0.5, A > 0 -> unclipped.
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0
    assert out.metrics["clip_frac"] == pytest.approx(0.5)


def test_group_advantages_and_filter_against_reference():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 0.0, 2.0]], dtype=torch.float64)
    adv = group_advantages(rewards)
    for g, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        for j, r in enumerate(row):
            assert adv[g, j].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-12)
    assert torch.equal(group_advantages(rewards, scale="none"), rewards - rewards.mean(1, keepdim=True))
    assert informative_groups(rewards).tolist() == [True, False, True]
    _, keep = dapo(group_size=4).advantages(rewards)
    assert keep.tolist() == [True, False, True]
    _, keep = grpo(group_size=4).advantages(rewards)
    assert keep.tolist() == [True, True, True]


def test_user_errors_are_reported():
    with pytest.raises(ValueError, match="aggregation"):
        PolicyLossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(PolicyLossConfig(kl_coef=0.1), logprobs=torch.zeros(1, 2), advantages=torch.zeros(1), mask=torch.ones(1, 2))
    with pytest.raises(TypeError, match="unknown option"):
        grpo(clip=0.3)
    with pytest.raises(ValueError, match="group_size"):
        grpo(group_size=1)
    assert dapo(clip_high=0.3).loss.clip_high == 0.3 and dapo().drop_uninformative_groups
