"""from_hf / to_hf refuse what they cannot represent, naming the field or tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tm_reference import build

import titan_models as tm


@pytest.fixture
def folder(tmp_path):
    config = tm.llama3.Llama3Config(vocab_size=64, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=48)
    tm.to_hf(build(config), tmp_path)
    return tmp_path


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_architecture(folder):
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported; supported: .*LlamaForCausalLM"):
        tm.from_hf(folder)


@pytest.mark.parametrize(("field", "value"), [("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True)])
def test_unsupported_config_field(folder, field, value):
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=f"field {field}="):
        tm.from_hf(folder)


def test_unsupported_rope_type(folder):
    _edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}, rope_scaling=None)
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        tm.from_hf(folder)


def test_missing_tensor(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        tm.from_hf(folder)


def test_unexpected_tensor(folder):
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.mlp.extra.weight'\]"):
        tm.from_hf(folder)


def test_shape_mismatch(folder):
    _edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' has shape \[31\], expected \[32\]"):
        tm.from_hf(folder)


def test_missing_files(tmp_path, folder):
    with pytest.raises(ValueError, match="has no config.json"):
        tm.from_hf(tmp_path / "nowhere")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        tm.from_hf(folder)


def test_to_hf_refuses_what_hf_cannot_hold(tmp_path):
    config = tm.llama3.Llama3Config(vocab_size=64, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=48)
    stage = build(config)
    del stage.layers["1"]
    with pytest.raises(ValueError, match="pipeline stage"):
        tm.to_hf(stage, tmp_path)
    with pytest.raises(ValueError, match="use RMSNorm"):
        tm.to_hf(build(tm.transforms.norm("layernorm")(config)), tmp_path)
    with torch.device("meta"):
        meta_model = config.build()
    with pytest.raises(ValueError, match="meta device"):
        tm.to_hf(meta_model, tmp_path)


def test_deepseek_and_qwen_settings_outside_the_models(tmp_path):
    config = tm.transforms.num_layers(2)(tm.flavor("deepseek_v3", "debug"))
    tm.to_hf(build(config), tmp_path)
    _edit_config(tmp_path, scoring_func="softmax")
    with pytest.raises(ValueError, match="field scoring_func='softmax' is not supported"):
        tm.from_hf(tmp_path)
    qwen = tmp_path / "qwen"
    tm.to_hf(build(tm.transforms.num_layers(1)(tm.flavor("qwen3", "debug"))), qwen)
    _edit_config(qwen, use_sliding_window=True)
    with pytest.raises(ValueError, match="field use_sliding_window=True is not supported"):
        tm.from_hf(qwen)


def test_expert_tensor_missing_or_misshapen(tmp_path):
    tm.to_hf(build(tm.transforms.num_layers(1)(tm.flavor("qwen3", "debug_moe"))), tmp_path)
    _edit_tensors(tmp_path, lambda t: t.pop("model.layers.0.mlp.experts.3.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.experts.3.down_proj.weight'\]"):
        tm.from_hf(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(256, 64)}))
    with pytest.raises(ValueError, match=r"experts.3.down_proj.weight' has shape \[256, 64\], expected \[256, 128\]"):
        tm.from_hf(tmp_path)
