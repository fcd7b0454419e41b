"""The built-in generator on DeepSeek-V4: each attention layer carries its inputs and keys=values in the
decode state (titan-models' CompressedAttentionCache, through `recurrent_states`), pooling the compressed
entries and the indexer's keys again as windows complete, so prefill + decode of right-padded prompts gives
what one full forward of each sequence gives, past the 16-token window and the 16-position heavy windows."""
from __future__ import annotations

import dataclasses

import titan_models as tm
import torch

from titan_rl import BuiltinGenerator, SamplingConfig


def test_prefill_then_decode_equals_one_forward():
    # index_topk 64 >= the sparse entries of these sequences: no indexer ties decide between the two paths
    model = dataclasses.replace(tm.flavor("deepseek_v4", "debug"), index_topk=64).build()
    model.init_weights(seed=0)
    model.eval()
    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30)]
    comps = BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=14, temperature=0.0))
    for prompt, comp in zip(prompts, comps):
        seq = torch.tensor([prompt + comp.tokens])
        with torch.no_grad():
            logprobs = model(seq).log_softmax(-1)[0]
        steps = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
        assert comp.tokens == [int(t) for t in logprobs[steps].argmax(-1)]  # greedy: each the argmax
        assert (comp.logprobs - logprobs[steps, seq[0, steps + 1]]).abs().max().item() < 1e-5
