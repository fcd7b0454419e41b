"""Qwen3.5 dense and MoE against transformers 5.20, both directions, in float32, at 80 tokens
(longer than the 64-token chunk of the Gated DeltaNet)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm
from titan_models.models.qwen3_5.flavors import qwen3_5_moe

TEXT = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, max_position_embeddings=256, rms_norm_eps=1e-6)


@pytest.fixture
def long_tokens():
    return torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(0))


def dense_config(*, tie=False, **changes):
    return transformers.Qwen3_5TextConfig(**(TEXT | {"intermediate_size": 96, "tie_word_embeddings": tie} | changes))


def moe_config(*, tie=False, top_k=2, **changes):
    return transformers.Qwen3_5MoeTextConfig(**(TEXT | dict(
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=top_k,
        tie_word_embeddings=tie) | changes))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_dense_from_hf_matches_transformers(tmp_path, long_tokens, tie):
    reference = save_hf(dense_config(tie=tie), tmp_path)
    model = tm.from_hf(tmp_path)
    assert isinstance(model.config, tm.qwen3_5.Qwen3_5Config) and model.config.moe is None
    assert model.config.layer_kinds() == ("linear_attention",) * 3 + ("full_attention",)
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5


@pytest.mark.parametrize(("top_k", "tie"), [(2, False), (1, True)], ids=["top2-untied", "top1-tied"])
def test_moe_from_hf_matches_transformers(tmp_path, long_tokens, top_k, tie):
    reference = save_hf(moe_config(top_k=top_k, tie=tie), tmp_path)
    model = tm.from_hf(tmp_path)
    assert model.config.moe.shared_width == 48 and model.config.moe.norm_topk_prob
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5
    for i in range(4):  # every layer is MoE and every token went to top_k experts
        assert model.layers[str(i)].moe.tokens_per_expert.sum().item() == long_tokens.numel() * top_k


def test_custom_layer_types_and_rotary_factor(tmp_path, long_tokens):
    types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    rope = {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}
    reference = save_hf(dense_config(layer_types=types, rope_parameters=rope), tmp_path)
    model = tm.from_hf(tmp_path)
    assert model.config.layer_kinds() == tuple(types) and model.rope.config.dim == 8
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5


def _perturbed(model):
    """Random values where init gives constants (norms, decay), so a swapped tensor would show."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "decay" in name or "shared_gate" in name:
                param.copy_(torch.rand(param.shape, generator=gen) * 0.5 + 0.25)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_to_hf_loads_in_transformers(tmp_path, long_tokens, moe):
    config = tm.qwen3_5.Qwen3_5Config(
        vocab_size=96, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        ffn_dim=None if moe else 96, moe=qwen3_5_moe(experts=8, top_k=2, expert_dim=32, shared_dim=48) if moe else None,
        rope_theta=10000.0)
    model = _perturbed(build(config, seed=3))
    tm.to_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
    reference = load_hf(tmp_path)
    with torch.no_grad():
        assert rel_err(reference(long_tokens).logits, model(long_tokens)) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(long_tokens), model(long_tokens))


def test_composite_checkpoint_loads_the_text_model_and_reports_the_rest(tmp_path, long_tokens):
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)
    config = transformers.Qwen3_5MoeConfig(text_config=moe_config().to_dict(), vision_config=vision,
                                           image_token_id=90, video_token_id=91, vision_start_token_id=92,
                                           vision_end_token_id=93)
    torch.manual_seed(0)
    reference = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if "norm" in name else torch.randn_like(param) * 0.05)
    reference.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:  # add an MTP head as published checkpoints have
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert any(n.startswith("model.language_model.layers.") for n in tensors)
    tensors |= {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.ones(64)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"text model only; \d+ tensors are not loaded .*under model.visual, "
                                         r"2 under mtp"):
        model = tm.from_hf(tmp_path)
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(input_ids=long_tokens).logits) < 1e-5


def test_bad_configs_name_the_field_or_tensor(tmp_path):
    save_hf(dense_config(), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"layer_types": ["linear_attention", "sliding_attention",
                                                                             "linear_attention", "full_attention"]}))
    with pytest.raises(ValueError, match="layer_types.*'sliding_attention'"):
        tm.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if "layers.1.linear_attn.A_log" not in name}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.linear_attn.A_log'\]"):
        tm.from_hf(tmp_path)
    config = tm.flavor("qwen3_5", "35B-A3B")
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        config.parallel_plan().check_tensor_parallel(4)
    config.parallel_plan().check_tensor_parallel(2)
    with pytest.raises(ValueError, match="layer_types has unknown entries"):
        tm.transforms.num_layers(2)(tm.flavor("qwen3_5", "debug")).__class__(
            **{**vars(tm.flavor("qwen3_5", "debug")), "layer_types": ("linear_attention", "mamba") * 2}).build()



def test_composite_text_config_fields_are_type_checked(tmp_path):
    save_hf(dense_config(), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    composite = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                 "text_config": hf | {"linear_num_value_heads": "4"}}
    (tmp_path / "config.json").write_text(json.dumps(composite))
    with pytest.raises(ValueError, match="text_config: field linear_num_value_heads is \"4\""):
        tm.from_hf(tmp_path)
