"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM, both directions, in float32."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm

YARN_V3 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_V2_LITE = YARN_V3 | {"mscale": 0.707, "mscale_all_dim": 0.707}


def deepseek_config(*, q_lora_rank=None, interleave=True, rope=None, n_group=1, topk_group=1, norm_topk_prob=True,
                    tie=False, scale=2.5):
    return transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=n_group, topk_group=topk_group, first_k_dense_replace=1,
        routed_scaling_factor=scale, norm_topk_prob=norm_topk_prob, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=interleave,
        max_position_embeddings=256, tie_word_embeddings=tie,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"} | (rope or {}))


CASES = {
    "kv-lora-interleaved": {},
    "q-lora-yarn-groups": {"q_lora_rank": 24, "interleave": False, "rope": YARN_V3, "n_group": 4, "topk_group": 2},
    "q-lora-yarn-mscale-tied": {"q_lora_rank": 24, "rope": YARN_V2_LITE, "n_group": 2, "topk_group": 1,
                                "norm_topk_prob": False, "tie": True, "scale": 1.0},
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_from_hf_matches_transformers(tmp_path, tokens, case):
    reference = save_hf(deepseek_config(**case), tmp_path)
    model = tm.from_hf(tmp_path)
    config = model.config
    assert isinstance(config, tm.deepseek_v3.DeepSeekV3Config) and not config.mtp
    assert model.layers["0"].feed_forward is not None and model.layers["1"].moe is not None
    assert model.layers["2"].moe.expert_bias.abs().sum() > 0  # e_score_correction_bias was loaded
    positions = torch.arange(24).expand(2, 24) + torch.tensor([[0], [30]])
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens).logits) < 1e-5
        assert rel_err(model(tokens, positions=positions), reference(tokens, position_ids=positions).logits) < 1e-5


@pytest.mark.parametrize("case", ["kv-lora-interleaved", "q-lora-yarn-groups"])
def test_to_hf_loads_in_transformers(tmp_path, tokens, case):
    reference_folder = tmp_path / "reference"
    save_hf(deepseek_config(**CASES[case]), reference_folder)
    config = tm.from_hf(reference_folder).config
    model = build(config, seed=7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for layer in ("1", "2"):
            model.layers[layer].moe.expert_bias.uniform_(-0.05, 0.05)
    tm.to_hf(model, tmp_path / "out")
    reference = load_hf(tmp_path / "out")
    with torch.no_grad():
        assert rel_err(reference(tokens).logits, model(tokens)) < 1e-5
        assert torch.equal(tm.from_hf(tmp_path / "out")(tokens), model(tokens))


def test_mtp_module_round_trips_in_deepseek_layout(tmp_path, tokens):
    config = dataclasses.replace(tm.transforms.num_layers(2)(tm.flavor("deepseek_v3", "debug")), mtp=True)
    model = build(config, seed=1)
    logits, mtp_logits = model.forward_with_mtp(tokens)
    assert torch.equal(logits, model(tokens)) and mtp_logits.shape == logits.shape
    # mtp_logits[:, i] sees tokens up to i + 1 only: changing the last token leaves i < s - 2 unchanged
    other = tokens.clone()
    other[:, -1] = (other[:, -1] + 1) % 96
    # (Not bitwise: the changed token moves rows between the MTP layer's experts, and a CPU GEMM's rounding
    # can depend on how many rows it multiplies; ~1e-6 seen. A leak of the token would move them by O(1).)
    changed = model.forward_with_mtp(other)[1].detach()
    assert (changed[:, :-2] - mtp_logits[:, :-2].detach()).abs().max() < 1e-4
    assert (changed[:, -2] - mtp_logits[:, -2].detach()).abs().max() > 0.1
    tm.to_hf(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.2.shared_head.head.weight").equal(model.output.weight)
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.embed_tokens.weight",
            "model.layers.2.mlp.experts.7.up_proj.weight", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"} <= names
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    loaded = tm.from_hf(tmp_path)
    assert loaded.config.mtp
    with torch.no_grad():
        a, b = loaded.forward_with_mtp(tokens), model.forward_with_mtp(tokens)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        # transformers ignores the MTP layer and still matches the main model
        assert rel_err(load_hf(tmp_path)(tokens).logits, model(tokens)) < 1e-5


def test_mtp_trains_and_requires_the_module(tokens):
    config = tm.transforms.num_layers(2)(tm.flavor("deepseek_v3", "debug"))
    with pytest.raises(ValueError, match="without an MTP module"):
        build(config).forward_with_mtp(tokens)
    model = build(dataclasses.replace(config, mtp=True))
    logits, mtp_logits = model.forward_with_mtp(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) + \
        0.3 * torch.nn.functional.cross_entropy(mtp_logits[:, :-2].flatten(0, 1), tokens[:, 2:].flatten())
    loss.backward()
    assert model.mtp.eh_proj.weight.grad.abs().sum() > 0
    assert model.mtp.layer.moe.router.gate.weight.grad is not None
