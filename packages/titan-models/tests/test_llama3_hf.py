"""Llama 3 against transformers' LlamaForCausalLM, both directions, in float32."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm


def llama_config(*, heads=4, kv_heads=2, tie=False, rope_scaling=None, layers=2):
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 5000.0, **(rope_scaling or {})})


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8}


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (8, 2)], ids=["mha", "gqa2", "mqa", "gqa4"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_from_hf_matches_transformers(tmp_path, tokens, heads, kv_heads, tie):
    reference = save_hf(llama_config(heads=heads, kv_heads=kv_heads, tie=tie), tmp_path)
    model = tm.from_hf(tmp_path)
    assert isinstance(model.config, tm.llama3.Llama3Config)
    assert model.config.tie_embeddings == tie and model.config.num_kv_heads == kv_heads
    assert tm.hf.read_config(tmp_path) == model.config  # the config alone, without reading weights
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5


def test_llama3_rope_scaling_and_positions_match(tmp_path, tokens):
    # original context 8 < sequence 24, so every branch of the llama3 frequency rule is exercised
    reference = save_hf(llama_config(rope_scaling=LLAMA3_SCALING), tmp_path)
    model = tm.from_hf(tmp_path)
    assert isinstance(model.config.rope_scaling, tm.llama3.Llama3RopeScaling)
    positions = torch.arange(24).expand(2, 24) + torch.tensor([[0], [40]])  # a later window for row 1
    with torch.no_grad():
        assert rel_err(model(tokens, positions=positions),
                       reference(tokens, position_ids=positions).logits) < 1e-5


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default_rope", "llama3_rope"])
def test_to_hf_loads_in_transformers_with_same_logits(tmp_path, tokens, tie, scaling):
    hf_scaling = None if scaling is None else tm.llama3.Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8)
    config = tm.llama3.Llama3Config(vocab_size=96, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96,
                                    head_dim=16, tie_embeddings=tie, rope_theta=5000.0, rope_scaling=hf_scaling,
                                    max_seq_len=256)
    model = build(config, seed=3)
    tm.to_hf(model, tmp_path)
    reference = load_hf(tmp_path)
    assert type(reference).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert rel_err(reference(tokens).logits, model(tokens)) < 1e-5
        # and back: bitwise the same model
        assert torch.equal(tm.from_hf(tmp_path)(tokens), model(tokens))


def test_sharded_folder_with_index_round_trips(tmp_path, tokens):
    model = build(tm.llama3.Llama3Config(vocab_size=96, dim=64, num_layers=3, num_heads=4, num_kv_heads=2,
                                         ffn_dim=96), seed=1)
    tm.to_hf(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    reference = load_hf(tmp_path)  # transformers reads the sharded folder
    loaded = tm.from_hf(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
        assert rel_err(reference(tokens).logits, model(tokens)) < 1e-5


def test_transformers_sharded_checkpoint_loads(tmp_path, tokens):
    reference = save_hf(llama_config(), tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert rel_err(tm.from_hf(tmp_path)(tokens), reference(tokens).logits) < 1e-5


def test_legacy_rope_config_spelling_is_read(tmp_path, tokens):
    reference = save_hf(llama_config(rope_scaling=LLAMA3_SCALING), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params  # transformers 4.x / published Llama 3.1 spelling
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert rel_err(tm.from_hf(tmp_path)(tokens), reference(tokens).logits) < 1e-5


def test_from_hf_dtype_and_device_arguments(tmp_path, tokens):
    save_hf(llama_config(), tmp_path)
    model = tm.from_hf(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.inv_freq.dtype == torch.float32  # RoPE frequencies stay exact
    assert model(tokens).dtype == torch.bfloat16


def test_bf16_model_writes_bf16_safetensors_transformers_reads(tmp_path, tokens):
    config = tm.llama3.Llama3Config(vocab_size=96, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96,
                                    dtype=torch.bfloat16)
    model = build(config, seed=2)
    tm.to_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, param in reference.named_parameters():
        assert param.dtype == torch.bfloat16, name
    assert torch.equal(reference.model.layers[1].mlp.down_proj.weight, model.layers["1"].feed_forward.w2.weight)
    loaded = tm.from_hf(tmp_path)  # dtype from config.json
    assert loaded.tok_embeddings.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
