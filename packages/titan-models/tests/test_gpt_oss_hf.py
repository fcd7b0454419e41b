"""gpt-oss against transformers' GptOssForCausalLM, both directions, in float32, at 80 tokens: longer
than transformers' 64-token chunk and ten times the sliding window, so windows and sinks both matter."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tm_reference import build, load_hf, rel_err, save_hf
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import titan_models as tm
from titan_models.hf.mxfp4 import dequantize_mxfp4

WINDOW = 8


def gpt_oss_config(*, layer_types=None, layers=4, top_k=2, rope=None):
    return transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=top_k, sliding_window=WINDOW,
        layer_types=layer_types, max_position_embeddings=4096, rope_parameters=rope)


@pytest.fixture
def long_tokens():
    return torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(0))


def saved_reference(hf_config, folder):
    """A random transformers model saved to `folder`, its sinks spread wide enough to matter."""
    model = save_hf(hf_config, folder)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("backend", ["flex", "eager", "sdpa"])
@pytest.mark.parametrize("layer_types", [None, ["full_attention", "sliding_attention", "sliding_attention",
                                                "full_attention"]], ids=["alternating", "custom"])
def test_gpt_oss_from_hf_matches_transformers(tmp_path, long_tokens, backend, layer_types):
    reference = saved_reference(gpt_oss_config(layer_types=layer_types), tmp_path)
    model = _with_backend(tmp_path, backend)
    assert isinstance(model.config, tm.gpt_oss.GptOssConfig)
    assert model.config.resolved_layer_types == tuple(reference.config.layer_types)
    windows = [model.layers[str(i)].attention.inner.sliding_window for i in range(4)]
    assert windows == [WINDOW if t == "sliding_attention" else None for t in reference.config.layer_types]
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5
    for i in range(4):  # every token went to top_k experts, and more than one expert was used
        counts = model.layers[str(i)].moe.tokens_per_expert
        assert counts.sum().item() == long_tokens.numel() * 2 and (counts > 0).sum() > 2


def _with_backend(folder, backend):
    """from_hf's weights in a model built with `backend` (from_hf builds the config's default, flex)."""
    model = build(tm.transforms.attention(backend)(tm.hf.read_config(folder)))
    model.load_state_dict(tm.from_hf(folder).state_dict())
    return model


def test_window_sinks_and_yarn_each_change_the_reference(tmp_path, long_tokens):
    """Controls for the test above: each gpt-oss feature moves transformers' logits."""
    base = saved_reference(gpt_oss_config(), tmp_path / "base")
    with torch.no_grad():
        want = base(long_tokens).logits
        wide = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", sliding_window=1000,
                                                                 attn_implementation="eager").eval()
        assert rel_err(wide(long_tokens).logits, want) > 1e-3
        for layer in wide.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        wide.config.sliding_window = WINDOW
    model = tm.from_hf(tmp_path / "base")
    with torch.no_grad():
        for i in range(4):
            model.layers[str(i)].attention.sinks.weight.fill_(-1e4)  # sinks off
        assert rel_err(model(long_tokens), want) > 1e-3


def test_gpt_oss_default_rope_loads(tmp_path, long_tokens):
    reference = saved_reference(gpt_oss_config(rope={"rope_type": "default", "rope_theta": 10000.0}), tmp_path)
    model = tm.from_hf(tmp_path)
    assert model.config.rope_scaling is None
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5


def test_gpt_oss_to_hf_loads_in_transformers(tmp_path, long_tokens):
    config = tm.gpt_oss.GptOssConfig(vocab_size=96, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                                     moe=tm.gpt_oss.gpt_oss_moe(num_experts=8, top_k=2, expert_dim=32),
                                     sliding_window=WINDOW, max_seq_len=4096)
    model = build(config, seed=3)
    with torch.no_grad():  # init leaves biases at zero and norms at one: move them so a swap would show
        for name, param in model.named_parameters():
            if "bias" in name or "sinks" in name:
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    tm.to_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["GptOssForCausalLM"] and hf["layer_types"][:2] == ["sliding_attention", "full_attention"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [E, dim, 2 ffn], gate at ::2
        assert torch.equal(gate_up[3, :, 0::2], model.layers["1"].moe.experts.w1[3].T)
        assert torch.equal(gate_up[3, :, 1::2], model.layers["1"].moe.experts.w3[3].T)
        assert not any("expert_bias" in n for n in f.keys())
    reference = load_hf(tmp_path)
    with torch.no_grad():
        assert rel_err(reference(long_tokens).logits, model(long_tokens)) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(long_tokens), model(long_tokens))


def test_mxfp4_dequantization_matches_transformers():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), want)
    assert dequantize_mxfp4(blocks, torch.full_like(scales, 255)).isnan().all()  # E8M0 NaN
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)


def test_mxfp4_checkpoint_loads_dequantized(tmp_path, long_tokens):
    """A folder laid out like the published ones: expert matrices as *_blocks/*_scales."""
    reference = saved_reference(gpt_oss_config(), tmp_path)
    g = torch.Generator().manual_seed(1)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for i, layer in enumerate(reference.model.layers):
        for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            blocks = torch.randint(0, 256, (8, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(120, 125, (8, rows, cols // 32), dtype=torch.uint8, generator=g)
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = tm.from_hf(tmp_path)
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5


def test_bad_configs_and_missing_tensors_name_the_problem(tmp_path):
    saved_reference(gpt_oss_config(), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "layer_types": ["sliding_attention", "chunked_attention",
                                                                          "full_attention", "full_attention"]}))
    with pytest.raises(ValueError, match="layer_types.*chunked_attention"):
        tm.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "model.layers.2.self_attn.sinks"}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.2.self_attn.sinks'\]"):
        tm.from_hf(tmp_path)
    config = tm.flavor("gpt_oss", "debug")
    for layer_types, match in ((("sliding_attention",) * 3 + ("linear_attention",), "layer_types.*linear_attention"),
                               (("full_attention",) * 3, "layer_types has 3 entries")):
        config.layer_types = layer_types
        with pytest.raises(ValueError, match=match):
            config.build()
