"""The built-in generator on gpt-oss: the KV cache carries sliding windows and attention sinks, so
prefill + decode gives what one full forward gives, past the window."""
from __future__ import annotations

import pytest
import titan_models as tm
import torch

from titan_rl import BuiltinGenerator, SamplingConfig

WINDOW = 8


def tiny_gpt_oss(backend: str, device: str = "cpu"):
    config = tm.gpt_oss.GptOssConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                     moe=tm.gpt_oss.gpt_oss_moe(num_experts=4, top_k=2, expert_dim=32),
                                     sliding_window=WINDOW, max_seq_len=512, attention=backend)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    model.init_weights(seed=0)
    sinks = torch.randn(len(model.layers), 4, generator=torch.Generator().manual_seed(1)) * 2.0
    with torch.no_grad():  # init leaves biases and sinks near zero: make the sinks matter
        for layer, values in zip(model.layers.values(), sinks):
            layer.attention.sinks.weight.copy_(values)
    return model


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_prefill_then_decode_equals_one_forward(backend):
    model = tiny_gpt_oss(backend)
    prompts = [[5, 9, 100], [17, 3] * 10]  # the longer prompt already exceeds the window
    comps = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0.0))
    for prompt, comp in zip(prompts, comps):
        seq = torch.tensor([prompt + comp.tokens])
        with torch.no_grad():
            logprobs = model(seq).log_softmax(-1)[0]
        steps = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
        expected = logprobs[steps, seq[0, steps + 1]]
        assert comp.tokens == [int(t) for t in logprobs[steps].argmax(-1)]  # greedy: each the argmax
        assert (comp.logprobs - expected).abs().max().item() < 1e-5


def test_window_and_sinks_matter_for_decode():
    """Control: a cache that ignored the window or the sinks would give other logprobs."""
    model = tiny_gpt_oss("sdpa")
    prompt = [[17, 3] * 10]
    comp = BuiltinGenerator(model).generate(prompt, SamplingConfig(max_new_tokens=4, temperature=0.0))[0]
    seq = torch.tensor([prompt[0] + comp.tokens])
    for change in ("window", "sinks"):
        other = tiny_gpt_oss("sdpa")
        with torch.no_grad():
            for layer in other.layers.values():
                if change == "window" and layer.attention.inner.sliding_window is not None:
                    layer.attention.inner.sliding_window = 1000
                if change == "sinks":
                    layer.attention.sinks.weight.fill_(-1e4)
            logprobs = other(seq).log_softmax(-1)[0]
        steps = torch.arange(len(prompt[0]) - 1, seq.shape[1] - 1)
        assert (comp.logprobs - logprobs[steps, seq[0, steps + 1]]).abs().max().item() > 1e-4, change


def _trainer_logprobs(model, completions, order, extra_pad, rng, vocab):
    """Trainer view: one right-padded batch of full sequences in `order`, plus unrelated rows."""
    from titan_rl import token_logprobs

    seqs = [completions[i].prompt + completions[i].tokens for i in order]
    seqs += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(2)]
    width = max(map(len, seqs)) + extra_pad
    tokens = torch.full((len(seqs), width), 7, dtype=torch.long, device=next(model.parameters()).device)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = torch.tensor(s, device=tokens.device)
    with torch.no_grad():
        lp = token_logprobs(model, tokens)
    return {i: lp[r, len(completions[i].prompt) - 1:len(completions[i].prompt) - 1 + len(completions[i].tokens)]
            for r, i in enumerate(order)}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="the GPU run of the same check"))]


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_and_generator_logprobs_are_bitwise_equal_in_batch_invariant_mode(device):
    """Sinks, windows and the MoE (router bias, top-k softmax, clamped SwiGLU) in batch-invariant mode:
    prefill and decode logprobs bitwise equal to the trainer's, in other batch compositions."""
    import random

    from titan_rl import batch_invariant

    model = batch_invariant(tiny_gpt_oss("flex", device))
    reference = tiny_gpt_oss("flex", device)
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (1, 9, 30, 12)]
    comps = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=10, seed=1))
    for order, pad in (([2, 0, 3, 1], 5), ([1, 3], 0)):
        trainer = _trainer_logprobs(model, comps, order, pad, rng, 128)
        for i in order:
            assert torch.equal(trainer[i].cpu(), comps[i].logprobs.cpu()), (order, i)
    # the mode computes the same function: close to the ordinary model's logprobs
    seq = torch.tensor([prompts[2] + comps[2].tokens], device=device)
    with torch.no_grad():
        want = reference(seq).log_softmax(-1)[0, len(prompts[2]) - 1:-1].gather(1, seq[0, len(prompts[2]):, None])
    assert (want[:, 0].cpu() - comps[2].logprobs.cpu()).abs().max().item() < 1e-4


def test_batch_invariant_gradients_match_the_ordinary_model():
    """The trainer's backward in the mode (sinks via the eager recompute, the MoE's own autograd)."""
    from titan_rl import batch_invariant, token_logprobs

    model, reference = batch_invariant(tiny_gpt_oss("flex")), tiny_gpt_oss("flex")
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    token_logprobs(model, tokens).sum().backward()
    reference(tokens).log_softmax(-1)[:, :-1].gather(2, tokens[:, 1:, None]).sum().backward()
    grads = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert grads[name].grad is not None, name
        if param.grad.norm() > 0:
            assert ((grads[name].grad - param.grad).norm() / param.grad.norm()).item() < 1e-5, name
