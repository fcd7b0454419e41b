"""Which models the vLLM adapter serves (titan_rl.vllm.support, no vLLM needed): linear-attention families
are refused with the reason, gpt-oss is served but not in batch-invariant mode, the served families
declare an architecture the plugin registers. The engine runs are in tests/vllm/ (tools/vllm-env)."""
from __future__ import annotations

import pytest
import titan_models as tm
import torch

from titan_rl.vllm import architectures
from titan_rl.vllm.support import check_servable, unservable_reason


def _model(family: str):
    with torch.device("meta"):
        return tm.transforms.num_layers(2)(tm.flavor(family, "debug")).build()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear"])
def test_linear_attention_families_are_refused(family):
    with pytest.raises(ValueError, match="linear-attention layers \\(GatedDeltaNet\\).*BuiltinGenerator"):
        check_servable(_model(family))


def test_families_without_a_vllm_architecture_are_refused():
    assert "declares no vLLM architecture" in unservable_reason(_model("deepseek_v3"))


def test_gpt_oss_is_served_except_in_batch_invariant_mode():
    model = _model("gpt_oss")
    assert unservable_reason(model) is None
    assert "TitanGptOssForCausalLM" in architectures()
    assert "no attention sinks or sliding windows" in unservable_reason(model, batch_invariant=True)
    for family in ("llama3", "qwen3"):  # full attention, no sinks: batch-invariant mode serves them
        assert unservable_reason(_model(family), batch_invariant=True) is None
