"""Qwen3 dense and Qwen3-MoE against transformers, both directions, in float32."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm
from titan_models.components.moe import MoEConfig


def qwen3_config(*, heads=4, kv_heads=2, tie=False):
    return transformers.Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def qwen3_moe_config(*, norm_topk_prob=True, top_k=2, sparse_step=1, mlp_only_layers=(), layers=2):
    return transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen3_from_hf_matches_transformers(tmp_path, tokens, heads, kv_heads, tie):
    reference = save_hf(qwen3_config(heads=heads, kv_heads=kv_heads, tie=tie), tmp_path)
    model = tm.from_hf(tmp_path)
    assert isinstance(model.config, tm.qwen3.Qwen3Config) and model.config.moe is None
    assert model.layers["0"].attention.q_norm is not None
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen3_to_hf_loads_in_transformers(tmp_path, tokens, tie):
    config = tm.qwen3.Qwen3Config(vocab_size=96, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  ffn_dim=96, tie_embeddings=tie)
    model = _perturbed_norms(build(config, seed=2))
    tm.to_hf(model, tmp_path)
    reference = load_hf(tmp_path)
    assert type(reference).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert rel_err(reference(tokens).logits, model(tokens)) < 1e-5


@pytest.mark.parametrize(
    ("norm_topk_prob", "top_k", "sparse_step", "mlp_only"),
    [(True, 2, 1, ()), (False, 2, 1, ()), (True, 1, 1, ()), (True, 3, 2, ()), (True, 2, 1, (0,))],
    ids=["top2-norm", "top2-raw", "top1", "top3-every2nd", "dense-layer0"],
)
def test_qwen3_moe_from_hf_matches_transformers(tmp_path, tokens, norm_topk_prob, top_k, sparse_step, mlp_only):
    reference = save_hf(qwen3_moe_config(norm_topk_prob=norm_topk_prob, top_k=top_k, sparse_step=sparse_step,
                                         mlp_only_layers=mlp_only), tmp_path)
    model = tm.from_hf(tmp_path)
    moe_layers = [i for i in range(2) if model.layers[str(i)].moe is not None]
    assert moe_layers == [i for i in range(2) if i not in mlp_only and (i + 1) % sparse_step == 0]
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5
    for i in moe_layers:  # every token went to top_k experts
        assert model.layers[str(i)].moe.tokens_per_expert.sum().item() == tokens.numel() * top_k


def test_qwen3_moe_to_hf_writes_per_expert_tensors_transformers_loads(tmp_path, tokens):
    config = tm.qwen3.Qwen3Config(vocab_size=96, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  ffn_dim=96, moe=MoEConfig(num_experts=8, top_k=2, expert_dim=32))
    model = _perturbed_norms(build(config, seed=4))
    tm.to_hf(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight").equal(
            model.layers["1"].moe.experts.w2[5])
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert not any("expert_bias" in n or "gate_up_proj" in n for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    reference = load_hf(tmp_path)
    with torch.no_grad():
        assert rel_err(reference(tokens).logits, model(tokens)) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(tokens), model(tokens))


def test_qwen3_moe_to_hf_rejects_routing_hf_cannot_express(tmp_path):
    config = tm.qwen3.Qwen3Config(vocab_size=96, dim=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                                  ffn_dim=96, moe=MoEConfig(num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1))
    with pytest.raises(ValueError, match="cannot be written"):
        tm.to_hf(build(config), tmp_path)


def _perturbed_norms(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model
