"""The built-in generator: KV-cache correctness, sampling and stop conditions, and bitwise agreement
with the trainer's logprobs in batch-invariant mode."""
from __future__ import annotations

import random

import pytest
import torch

from titan_rl import BuiltinGenerator, SamplingConfig, batch_invariant, token_logprobs


def _trainer_logprobs(model, completions, order, extra_pad, rng):
    """Trainer view: one right-padded batch of full sequences in `order`, plus unrelated rows."""
    seqs = [completions[i].prompt + completions[i].tokens for i in order]
    seqs += [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(0, 2))]
    S = max(map(len, seqs)) + extra_pad
    tokens = torch.full((len(seqs), S), 7, dtype=torch.long)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        lp = token_logprobs(model, tokens)
    out = {}
    for r, i in enumerate(order):
        P, C = len(completions[i].prompt), len(completions[i].tokens)
        out[i] = lp[r, P - 1:P - 1 + C]
    return out


def test_trainer_and_generator_logprobs_are_bitwise_equal_in_batch_invariant_mode(tiny_llama):
    model = batch_invariant(tiny_llama())
    gen = BuiltinGenerator(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 9, 30, 64, 70, 3)]
    # Two generator batches of different composition: all prompts, and a subset in another order.
    first = gen.generate(prompts, SamplingConfig(max_new_tokens=10, seed=1))
    subset = [4, 1]
    again = gen.generate([prompts[i] for i in subset], SamplingConfig(max_new_tokens=10, seed=1))
    for trial in range(2):
        order = rng.sample(range(len(prompts)), rng.randint(1, len(prompts)))
        trainer = _trainer_logprobs(model, first, order, extra_pad=rng.randint(0, 9), rng=rng)
        for i in order:
            # token 0 was reached by prefill, the others by decode
            assert torch.equal(trainer[i], first[i].logprobs), (trial, i)
    trainer = _trainer_logprobs(model, again, [0, 1], extra_pad=3, rng=rng)
    for r in range(2):
        assert torch.equal(trainer[r], again[r].logprobs)


def test_mismatch_without_the_mode_is_small_but_not_zero(capsys):
    # dim 256 and prompts past 64 tokens: at dim 128 with short prompts the CPU's single-row (decode)
    # and many-row (trainer) GEMMs happened to sum in the same order, and the control measured nothing.
    import titan_models as tm

    config = tm.llama3.Llama3Config(vocab_size=512, dim=256, num_layers=2, num_heads=4, num_kv_heads=1,
                                    ffn_dim=768, max_seq_len=512)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = BuiltinGenerator(model)
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (2, 17, 100, 130)]
    comps = gen.generate(prompts, SamplingConfig(max_new_tokens=10, seed=2))
    trainer = _trainer_logprobs(model, comps, [2, 0, 3, 1], extra_pad=5, rng=rng)
    diffs = torch.cat([(trainer[i] - comps[i].logprobs).abs() for i in trainer])
    print(f"normal mode |dlogprob|: max {diffs.max():.3g} mean {diffs.mean():.3g} over {diffs.numel()} tokens")
    assert diffs.max() < 1e-3  # same math, different kernels: rounding-level differences only
    # ...and the control has teeth: without the mode the two views do differ (if they agreed here too,
    # the bitwise test above would prove nothing about the mode).
    assert diffs.max() > 0, "without batch-invariant mode the generator matched the trainer bitwise"


def test_greedy_generation_matches_recomputing_the_full_sequence(tiny_llama):
    # The KV cache must give what a cache-free forward over the whole sequence gives.
    model = tiny_llama()
    gen = BuiltinGenerator(model)
    prompts = [[5, 9, 100], [17] * 20]
    comps = gen.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.0))
    for prompt, comp in zip(prompts, comps):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert comp.tokens == seq[len(prompt):] and comp.finish_reason == "length"
        assert comp.logprobs.shape == (6,) and bool((comp.logprobs <= 0).all())


def test_stop_conditions_and_seeded_sampling(tiny_llama):
    model = tiny_llama()
    gen = BuiltinGenerator(model)
    prompt = [[3, 4, 5]]
    free = gen.generate(prompt, SamplingConfig(max_new_tokens=8, seed=11))[0]
    assert free.tokens == gen.generate(prompt, SamplingConfig(max_new_tokens=8, seed=11))[0].tokens
    stop_tok = free.tokens[3]
    cut = free.tokens.index(stop_tok) + 1
    stopped = gen.generate(prompt, SamplingConfig(max_new_tokens=8, seed=11, stop_token_ids=(stop_tok,)))[0]
    assert stopped.tokens == free.tokens[:cut] and stopped.finish_reason == "stop"
    assert torch.equal(stopped.logprobs, free.logprobs[:cut])
    seq = tuple(free.tokens[1:3])
    by_seq = gen.generate(prompt, SamplingConfig(max_new_tokens=8, seed=11, stop_sequences=(seq,)))[0]
    assert tuple(by_seq.tokens[-2:]) == seq and by_seq.finish_reason == "stop"


def test_top_p_keeps_only_the_nucleus():
    from titan_rl.generation import sample_next
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    drawn = sample_next(logits, SamplingConfig(top_p=0.7), g)
    counts = torch.bincount(drawn, minlength=4).double() / len(drawn)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0] - 0.5 / 0.8) < 0.03
    assert torch.equal(sample_next(logits[:2], SamplingConfig(temperature=0.0), g), torch.tensor([0, 0]))


def test_batch_invariant_mode_keeps_parameters_and_outputs(tiny_llama):
    model = tiny_llama()
    before = {k: v for k, v in model.state_dict().items()}
    x = torch.randint(0, 512, (2, 33))
    with torch.no_grad():
        ref = model(x)
        batch_invariant(model)
        out = model(x)
    after = model.state_dict()
    assert list(before) == list(after) and all(before[k] is after[k] or torch.equal(before[k], after[k]) for k in before)
    assert (out - ref).abs().max() < 1e-4
    with pytest.raises(ValueError, match="packed documents"):
        import titan_models as tm
        model(x, context=tm.AttentionContext(document_ids=torch.zeros_like(x)))


def test_weight_update_bumps_the_version(tiny_llama):
    trainer_model = tiny_llama(seed=0)
    gen = BuiltinGenerator(trainer_model, copy_model=True)
    prompt = [[1, 2, 3]]
    greedy = SamplingConfig(max_new_tokens=5, temperature=0.0)
    old = gen.generate(prompt, greedy)[0]
    new_weights = tiny_llama(seed=1)
    gen.update_weights(new_weights.state_dict(), version=1)
    new = gen.generate(prompt, greedy)[0]
    assert new.policy_version == 1 and old.policy_version == 0
    expected = BuiltinGenerator(new_weights).generate(prompt, greedy)[0]
    assert new.tokens == expected.tokens and torch.equal(new.logprobs, expected.logprobs)
    with pytest.raises(ValueError, match="does not have"):
        gen.update_weights({"nope": torch.zeros(1)}, version=2)


def _tied_llama(seed: int):
    import titan_models as tm

    config = tm.llama3.Llama3Config(vocab_size=512, dim=128, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=384,
                                    max_seq_len=512, tie_embeddings=True)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_weight_update_of_a_tied_model_keeps_it_tied():
    """A tied model's state dict names the shared matrix twice (tok_embeddings.weight and output.weight, as
    Llama 3 1B's does): the generator takes it once, stays tied, and then holds the new weights bitwise."""
    gen = BuiltinGenerator(_tied_llama(seed=0), copy_model=True)
    new_weights = _tied_llama(seed=1)
    state = new_weights.state_dict()
    assert state["output.weight"].data_ptr() == state["tok_embeddings.weight"].data_ptr()
    gen.update_weights(state, version=1)
    assert gen.model.output.weight is gen.model.tok_embeddings.weight
    assert gen.model.state_dict().keys() == state.keys()
    assert all(torch.equal(value, state[name]) for name, value in gen.model.state_dict().items())
    assert not torch.equal(state["tok_embeddings.weight"], _tied_llama(seed=0).tok_embeddings.weight)  # it changed
    greedy = SamplingConfig(max_new_tokens=5, temperature=0.0)
    expected = BuiltinGenerator(new_weights).generate([[1, 2, 3]], greedy)[0]
    assert torch.equal(gen.generate([[1, 2, 3]], greedy)[0].logprobs, expected.logprobs)
    # separate copies of the same values (weights that came by message) are fine; an untied pair is not
    gen.update_weights({name: value.clone() for name, value in state.items()}, version=2)
    untied = {name: value.clone() for name, value in state.items()}
    untied["output.weight"] += 1.0
    with pytest.raises(ValueError, match="tied parameter"):
        gen.update_weights(untied, version=3)


@pytest.mark.parametrize("family, flavor, dtype", [("qwen3", "debug", torch.float32), ("llama3", "debug", torch.bfloat16),
                                                   ("qwen3", "debug_moe", torch.float32)])
def test_bitwise_agreement_for_other_families_and_bf16(family, flavor, dtype):
    import titan_models as tm
    config = tm.transforms.compose(tm.transforms.num_layers(1), tm.transforms.dtype(dtype))(tm.flavor(family, flavor))
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    batch_invariant(model)  # Qwen3's q_norm / k_norm are RMSNorms too
    rng = random.Random(3)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (3, 40, 9)]
    comps = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=6, seed=0))
    trainer = _trainer_logprobs(model, comps, [2, 0, 1], extra_pad=4, rng=rng)
    for i in range(3):
        assert torch.equal(trainer[i], comps[i].logprobs)


@pytest.mark.parametrize("family, flavor", [("qwen3_5", "debug"), ("qwen3_next", "debug"), ("kimi_linear", "debug")])
def test_linear_attention_state_through_prefill_and_decode_matches_a_full_forward(family, flavor):
    # Gated DeltaNet / Kimi Delta Attention layers carry conv + delta-rule state from a right-padded prefill
    # (prompts up to 70 tokens, past the 64-token chunk) through decode; the logits must be a full forward's.
    import titan_models as tm
    config = tm.flavor(family, flavor)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (70, 3, 33)]
    comps = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=5, seed=0))
    with torch.no_grad():
        for prompt, comp in zip(prompts, comps):
            seq = torch.tensor([prompt + comp.tokens])
            full = torch.log_softmax(model(seq)[0].float(), dim=-1)
            expected = full[len(prompt) - 1:-1].gather(1, torch.tensor(comp.tokens)[:, None])[:, 0]
            assert (expected - comp.logprobs).abs().max() < 1e-4, (prompt[:3], expected, comp.logprobs)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_linear_attention_models_are_refused_in_batch_invariant_mode(family):
    import titan_models as tm
    with torch.device("meta"):
        model = tm.flavor(family, "debug").build()
    with pytest.raises(ValueError, match="linear-attention"):
        batch_invariant(model)


@pytest.mark.parametrize("family", ["muse_glimmer", "muse_spark"])
def test_muse_windows_and_softcap_through_prefill_and_decode_match_a_full_forward(family):
    # Prompts up to 90 tokens, past the debug models' 64-key sliding windows (NoPE full layer included);
    # the output weights scaled so the soft-capped logits sit in tanh's curved range.
    import titan_models as tm
    config = tm.flavor(family, "debug")
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(300.0)
    rng = random.Random(7)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (90, 5, 66)]
    comps = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=6, seed=0))
    with torch.no_grad():
        for prompt, comp in zip(prompts, comps):
            logits = model(torch.tensor([prompt + comp.tokens]))[0].float()
            assert (logits.abs() > config.logit_softcap / 2).float().mean() > 0.3
            full = torch.log_softmax(logits, dim=-1)
            expected = full[len(prompt) - 1:-1].gather(1, torch.tensor(comp.tokens)[:, None])[:, 0]
            # fp32 rounding through a 300x head: ~2e-5 on logprobs near -7 (1e-4 as for linear attention)
            assert (expected - comp.logprobs).abs().max() < 1e-4, (prompt[:3], expected, comp.logprobs)
    # no fixed-order kernels for Muse's norms, gates and soft-cap: refused, naming them (the README gives the
    # generator-vs-trainer mismatch measured without the mode)
    with pytest.raises(ValueError, match="zero-centred, scaleless or input-scaled norms.*Muse"):
        batch_invariant(model)
