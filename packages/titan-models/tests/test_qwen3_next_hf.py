"""Qwen3-Next against transformers 5.20, both directions, in float32, at 80 tokens: the fused
per-key-head in_proj_qkvz / in_proj_ba layout, norm_topk_prob both ways, dense layers, tied heads."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm
from titan_models.models.qwen3_next.flavors import qwen3_next_moe
from titan_models.models.qwen3_next.hf import grouped_rows


@pytest.fixture
def long_tokens():
    return torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(1))


def next_config(*, norm_topk_prob=True, top_k=2, mlp_only_layers=(), sparse_step=1, tie=False, value_heads=4):
    return transformers.Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=value_heads,
        linear_key_head_dim=8, linear_value_head_dim=12, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=sparse_step, tie_word_embeddings=tie, max_position_embeddings=256)


@pytest.mark.parametrize(
    ("norm_topk_prob", "top_k", "mlp_only", "sparse_step", "tie", "value_heads"),
    [(True, 2, (), 1, False, 4), (False, 2, (0,), 1, False, 4), (True, 3, (), 2, True, 2), (False, 1, (), 1, True, 6)],
    ids=["top2-norm", "top2-raw-dense0", "top3-every2nd-tied", "top1-raw-tied-3v"])
def test_from_hf_matches_transformers(tmp_path, long_tokens, norm_topk_prob, top_k, mlp_only, sparse_step, tie,
                                      value_heads):
    reference = save_hf(next_config(norm_topk_prob=norm_topk_prob, top_k=top_k, mlp_only_layers=mlp_only,
                                    sparse_step=sparse_step, tie=tie, value_heads=value_heads), tmp_path)
    model = tm.from_hf(tmp_path)
    assert isinstance(model.config, tm.qwen3_next.Qwen3NextConfig)
    assert model.config.moe.norm_topk_prob == norm_topk_prob
    moe_layers = [i for i in range(4) if model.layers[str(i)].moe is not None]
    assert moe_layers == [i for i in range(4) if i not in mlp_only and (i + 1) % sparse_step == 0]
    with torch.no_grad():
        assert rel_err(model(long_tokens), reference(long_tokens).logits) < 1e-5
    for i in moe_layers:
        assert model.layers[str(i)].moe.tokens_per_expert.sum().item() == long_tokens.numel() * top_k


def test_fused_rows_follow_the_per_key_head_layout(tmp_path):
    save_hf(next_config(), tmp_path)
    model = tm.from_hf(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        qkvz = f.get_tensor("model.layers.0.linear_attn.in_proj_qkvz.weight")
    group = qkvz.view(2, 2 * 8 + 2 * 2 * 12, 64)  # [key head, q | k | v of 2 value heads | z of them, dim]
    gdn = model.layers["0"].attention
    assert torch.equal(gdn.wq.weight, group[:, :8].reshape(-1, 64))
    assert torch.equal(gdn.wz.weight, group[:, 16 + 24:].reshape(-1, 64))
    config = model.config
    all_rows = sorted(sum((grouped_rows(config, p) for p in ("wq", "wk", "wv", "wz")), ()))
    assert all_rows == list(range(qkvz.shape[0]))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_to_hf_loads_in_transformers(tmp_path, long_tokens, tie):
    config = tm.qwen3_next.Qwen3NextConfig(
        vocab_size=96, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, ffn_dim=96, dense_layers=(1,),
        moe=qwen3_next_moe(experts=8, top_k=2, expert_dim=32, shared_dim=48, norm_topk_prob=False),
        rope_theta=10000.0, tie_embeddings=tie)
    model = build(config, seed=5)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "decay" in name:
                param.copy_(torch.rand(param.shape, generator=gen) * 0.5 + 0.25)
    tm.to_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3NextForCausalLM"] and hf["norm_topk_prob"] is False
    reference = load_hf(tmp_path)
    with torch.no_grad():
        assert rel_err(reference(long_tokens).logits, model(long_tokens)) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path)(long_tokens), model(long_tokens))


def test_head_counts_the_plan_cannot_split():
    plan = tm.flavor("qwen3_next", "80B-A3B").parallel_plan()
    plan.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        plan.check_tensor_parallel(8)
    odd = tm.qwen3_next.Qwen3NextConfig(vocab_size=96, dim=64, num_layers=4, num_heads=6, num_kv_heads=6,
                                        head_dim=16, linear_num_key_heads=3, linear_num_value_heads=6, ffn_dim=96)
    with pytest.raises(ValueError, match="linear_num_key_heads=3"):
        odd.parallel_plan().check_tensor_parallel(2)
