"""MoE policies (Qwen3-MoE, DeepSeek-V3 with group-limited routing) in batch-invariant mode: a token's
expert choice and arithmetic do not depend on the batch, so the built-in generator's logprobs (prefill +
decode) equal the trainer's (one forward) bitwise, in any batch composition; without the mode they differ."""
from __future__ import annotations

import random

import pytest
import titan_models as tm
import torch
from titan_models.components.moe import MoE

from titan_rl import BuiltinGenerator, SamplingConfig, batch_invariant, token_logprobs
from titan_rl.batch_invariant.moe import BatchInvariantMoE

# Two layers each: Qwen3-MoE's are both MoE; DeepSeek-V3's first is dense (first_k_dense=1), the second
# routes over 8 experts in 2 groups, one group kept per token (MLA attention, sigmoid scores, a shared expert).
POLICIES = [("qwen3", "debug_moe"), ("deepseek_v3", "debug")]


def _policy(family: str, flavor: str, *, seed: int = 0) -> torch.nn.Module:
    config = tm.transforms.num_layers(2)(tm.flavor(family, flavor))
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    with torch.no_grad():  # a nonzero aux-loss-free bias, as a trained model has: it must steer selection alike
        for module in model.modules():
            if isinstance(module, MoE):
                module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return model


def _trainer_logprobs(model, completions, order, *, extra_pad: int, rng: random.Random) -> dict[int, torch.Tensor]:
    """The trainer's view: one right-padded forward over the full sequences in `order` plus 0-2 unrelated rows;
    the completions' logprobs by index."""
    seqs = [completions[i].prompt + completions[i].tokens for i in order]
    seqs += [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(0, 2))]
    tokens = torch.full((len(seqs), max(map(len, seqs)) + extra_pad), 7, dtype=torch.long)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        lp = token_logprobs(model, tokens)
    return {i: lp[r, len(completions[i].prompt) - 1:len(completions[i].prompt) - 1 + len(completions[i].tokens)]
            for r, i in enumerate(order)}


def _prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family, flavor", POLICIES)
def test_moe_trainer_and_generator_logprobs_are_bitwise_equal_in_batch_invariant_mode(family, flavor):
    model = batch_invariant(_policy(family, flavor))
    vocab = model.config.vocab_size
    gen = BuiltinGenerator(model)
    prompts = _prompts(vocab, (70, 3, 17, 1, 40), seed=0)   # one past the 64-key attention block
    sampling = SamplingConfig(max_new_tokens=6, seed=1)
    everyone = gen.generate(prompts, sampling)
    alone = gen.generate([prompts[2]], sampling)[0]  # another generator batch (other tokens sampled)
    rng = random.Random(2)
    for order, extra_pad in (([0, 1, 2, 3, 4], 0), ([3, 0], 7), ([4, 2, 1], 2)):
        trainer = _trainer_logprobs(model, everyone, order, extra_pad=extra_pad, rng=rng)
        for i in order:  # token 0 was reached by prefill, the others by decode
            assert torch.equal(trainer[i], everyone[i].logprobs), (order, i, trainer[i] - everyone[i].logprobs)
    trainer_alone = _trainer_logprobs(model, [alone], [0], extra_pad=5, rng=rng)[0]
    assert torch.equal(trainer_alone, alone.logprobs)


@pytest.mark.parametrize("family, flavor", POLICIES)
def test_moe_mismatch_without_the_mode_is_small_but_not_zero(family, flavor):
    # The control: the same comparison on the ordinary model (index_add_ sums, size-dependent GEMMs, torch's
    # softmax / sigmoid) must show a mismatch, or the bitwise test above would prove nothing about the mode.
    model = _policy(family, flavor)
    comps = BuiltinGenerator(model).generate(_prompts(model.config.vocab_size, (100, 2, 17, 130), seed=1),
                                             SamplingConfig(max_new_tokens=8, seed=2))
    trainer = _trainer_logprobs(model, comps, [2, 0, 3, 1], extra_pad=5, rng=random.Random(3))
    diffs = torch.cat([(trainer[i] - comps[i].logprobs).abs() for i in trainer])
    print(f"{family} without the mode |dlogprob|: max {diffs.max():.3g} mean {diffs.mean():.3g} over {diffs.numel()}")
    assert 0 < diffs.max() < 1e-3


def _layer(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if isinstance(m, (MoE, BatchInvariantMoE)))


@pytest.mark.parametrize("family, flavor", POLICIES)
def test_routing_is_per_token_and_matches_titan_models(family, flavor):
    reference = _layer(_policy(family, flavor))
    moe = _layer(batch_invariant(_policy(family, flavor)))
    dim = reference.router.gate.in_features
    x = torch.randn(1, 37, dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        weights, experts = moe._route(x[0])
        ref_weights, ref_experts = reference.router(x[0], reference.expert_bias)
        # The same experts as titan-models' router (its order is unsorted: compare as sets) and the same weights
        # up to rounding; titan-models' router is the independent reference of the group-limited semantics.
        assert torch.equal(experts.sort(dim=1).values, ref_experts.sort(dim=1).values)
        order = ref_experts.argsort(dim=1)
        ref_sorted = ref_weights.gather(1, order)
        mine_sorted = weights.gather(1, experts.argsort(dim=1))
        assert torch.allclose(mine_sorted, ref_sorted, rtol=1e-6, atol=1e-7)
        # Per token, bitwise: each token routed alone, and inside other batches, gets the same experts, weights
        # and layer output.
        out = moe(x)
        for t in (0, 5, 36):
            w1, e1 = moe._route(x[0, t:t + 1])
            assert torch.equal(e1, experts[t:t + 1]) and torch.equal(w1, weights[t:t + 1])
            assert torch.equal(moe(x[:, t:t + 1]), out[:, t:t + 1])
        mixed = torch.cat([x[:, 30:], x[:, :3]], dim=1)
        assert torch.equal(moe(mixed)[:, :7], out[:, 30:])
        assert (out - reference(x)).abs().max() < 1e-5


def test_group_limits_change_the_choice_and_are_honoured():
    # DeepSeek-V3's debug routing keeps one of two groups of 4 experts: both chosen experts of every token come
    # from one group, and for some tokens that is not what an ungrouped top-2 would pick.
    moe = _layer(batch_invariant(_policy("deepseek_v3", "debug")))
    cfg = moe.config
    assert (cfg.n_group, cfg.topk_group, cfg.top_k) == (2, 1, 2)
    x = torch.randn(200, moe.router.gate.in_features, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, experts = moe._route(x)
        scores = torch.sigmoid(x.double() @ moe.router.gate.weight.double().T) + moe.expert_bias.double()
    per_group = cfg.num_experts // cfg.n_group
    assert bool((experts[:, 0] // per_group == experts[:, 1] // per_group).all())
    ungrouped = scores.topk(2, dim=1).indices
    assert bool((ungrouped.sort(dim=1).values != experts.sort(dim=1).values).any(dim=1).any())


def test_moe_features_without_a_batch_invariant_form_are_refused_before_any_change():
    with torch.device("meta"):
        model = tm.transforms.num_layers(2)(tm.flavor("deepseek_v4", "debug")).build()
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(ValueError, match="sqrtsoftplus.*hash routing"):
        batch_invariant(model)
    assert [n for n, _ in model.named_modules()] == names and not any(
        isinstance(m, BatchInvariantMoE) for m in model.modules())


@pytest.mark.parametrize("family, flavor", POLICIES)
def test_batch_invariant_gradients_match_the_ordinary_model(family, flavor):
    """The trainer's backward through the mode's MoE (group-limited routing included) is the ordinary model's."""
    model, reference = batch_invariant(_policy(family, flavor)), _policy(family, flavor)
    tokens = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    token_logprobs(model, tokens).sum().backward()
    reference(tokens).log_softmax(-1)[:, :-1].gather(2, tokens[:, 1:, None]).sum().backward()
    grads = dict(model.named_parameters())
    checked = 0
    for name, param in reference.named_parameters():
        assert grads[name].grad is not None, name
        if param.grad.norm() > 0:
            assert ((grads[name].grad - param.grad).norm() / param.grad.norm()).item() < 1e-5, name
            checked += ".moe." in name
    assert checked >= 4  # router, experts (w1, w2, w3) and shared experts have gradients
