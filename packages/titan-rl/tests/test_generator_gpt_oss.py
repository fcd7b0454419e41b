"""The built-in generator on gpt-oss: the KV cache carries sliding windows and attention sinks, so
prefill + decode gives what one full forward gives, past the window."""
from __future__ import annotations

import pytest
import titan_models as tm
import torch

from titan_rl import BuiltinGenerator, SamplingConfig

WINDOW = 8


def tiny_gpt_oss(backend: str):
    config = tm.gpt_oss.GptOssConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                     moe=tm.gpt_oss.gpt_oss_moe(num_experts=4, top_k=2, expert_dim=32),
                                     sliding_window=WINDOW, max_seq_len=512, attention=backend)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():  # init leaves biases and sinks near zero: make the sinks matter
        for layer in model.layers.values():
            layer.attention.sinks.weight.normal_(0.0, 2.0)
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
