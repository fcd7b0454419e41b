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


# --- damaged folders: a ValueError naming the file and the tensor or field ------------------------------

def test_empty_or_truncated_safetensors(folder):
    data = (folder / "model.safetensors").read_bytes()
    for cut in (b"", data[:5], data[:-7]):  # empty, inside the header size, inside the last tensor
        (folder / "model.safetensors").write_bytes(cut)
        with pytest.raises(ValueError, match=rf"model.safetensors is not a readable safetensors file \({len(cut)} "):
            tm.from_hf(folder)


def _shard(folder, index):
    """The single file as a one-shard folder with the index `index` (a dict, or raw text)."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    text = index if isinstance(index, str) else json.dumps(index)
    (folder / "model.safetensors.index.json").write_text(text)


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": ["a"]}, [1, 2], "{not json"])
def test_index_without_weight_map(folder, index):
    _shard(folder, index)
    with pytest.raises(ValueError, match=r"index.json (has no 'weight_map' object|is not valid JSON)"):
        tm.from_hf(folder)


def test_index_naming_a_file_without_the_tensor(folder):
    names = load_file(folder / "model.safetensors").keys()
    weight_map = {name: "model-00001-of-00001.safetensors" for name in names}
    _shard(folder, {"weight_map": weight_map})
    save_file({"model.norm.weight": torch.ones(32)}, folder / "other.safetensors", metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "other.safetensors"}}))
    with pytest.raises(ValueError, match=r"maps 'lm_head.weight' to other.safetensors, which does not hold it"):
        tm.from_hf(folder)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_name_the_file_and_tensor(folder, value):
    def poison(tensors):
        tensors["model.layers.1.self_attn.k_proj.weight"][3, 5] = value
    _edit_tensors(folder, poison)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight' "
                                         r"holds 1 NaN or inf values \(of 512\)"):
        tm.from_hf(folder)


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_size": "32"}, r"field hidden_size is \"32\" \(a JSON string\); it must be an integer >= 1"),
    ({"num_hidden_layers": 2.0}, r"field num_hidden_layers is 2.0 \(a JSON number\); it must be an integer >= 1"),
    ({"vocab_size": -64}, r"field vocab_size is -64 .*integer >= 1"),
    ({"num_attention_heads": None}, r"field num_attention_heads is null \(a JSON null\)"),
    ({"rms_norm_eps": "1e-5"}, r"field rms_norm_eps is \"1e-5\" \(a JSON string\); it must be a finite number"),
    ({"tie_word_embeddings": "false"}, r"field tie_word_embeddings is \"false\" .*true or false"),
    ({"rope_scaling": "llama3"}, r"field rope_scaling is \"llama3\" .*an object"),
    ({"architectures": "LlamaForCausalLM"}, r"field architectures is \"LlamaForCausalLM\" .*array of strings"),
])
def test_config_fields_of_the_wrong_type(folder, changes, message):
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        tm.from_hf(folder)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"])
def test_config_missing_a_field(folder, field):
    config = json.loads((folder / "config.json").read_text())
    del config[field]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json has no field '{field}', which Llama3Converter needs"):
        tm.hf.read_config(folder)


@pytest.mark.parametrize("text", ["[1, 2]", '"LlamaForCausalLM"', "{\"vocab_size\": 64,"])
def test_config_that_is_not_an_object(folder, text):
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config.json (holds a JSON (list|str), not an object|is not valid JSON)"):
        tm.from_hf(folder)


def test_non_finite_one_byte_floats_are_found_too(tmp_path):
    from titan_models.hf.safetensors_io import SafetensorsFolder

    good = torch.tensor([1.0, -448.0, 0.5]).to(torch.float8_e4m3fn)
    bad = torch.tensor([1.0, float("nan"), 0.5]).to(torch.float8_e4m3fn)
    save_file({"good": good, "bad": bad}, tmp_path / "model.safetensors")
    files = SafetensorsFolder(tmp_path)
    assert torch.equal(files.get("good").view(torch.uint8), good.view(torch.uint8))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'bad' holds 1 NaN or inf values \(of 3\)"):
        files.get("bad")
