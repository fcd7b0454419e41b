"""DeepSeek-V4 has no KV-cache state for its compressors and indexer yet: the built-in generator says so
(a ValueError naming the family) instead of decoding with windows it cannot carry."""
from __future__ import annotations

import pytest
import titan_models as tm
import torch

from titan_rl import BuiltinGenerator, SamplingConfig


def test_builtin_generator_refuses_deepseek_v4_by_name():
    model = tm.flavor("deepseek_v4", "debug").build()
    model.init_weights(seed=0)
    prompt = [torch.randint(0, 2048, (8,), generator=torch.Generator().manual_seed(0)).tolist()]
    with pytest.raises(ValueError, match="'deepseek_v4' does not run with the KV cache"):
        BuiltinGenerator(model).generate(prompt, SamplingConfig(max_new_tokens=2, temperature=0.0))
