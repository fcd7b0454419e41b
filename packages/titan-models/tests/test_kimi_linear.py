"""Kimi Linear: Kimi Delta Attention's per-channel delta rule (chunked and recurrent) against a float64
recurrence and transformers' torch reference, packed documents against each document alone, the model's
causality and document isolation, config.json spellings and refusals, the 48B-A3B size."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from tm_delta_rule_reference import float64_delta_rule
from tm_reference import build, rel_err

import titan_models as tm
from titan_models.components.gated_deltanet import chunked_delta_rule, l2_normalize, recurrent_delta_rule
from titan_models.context import AttentionContext
from titan_models.models.kimi_linear.hf import TINY_HF_CONFIGS


def inputs(b=2, s=150, h=3, dk=8, dv=12, seed=0, strong=False):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, s, h, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(b, s, h, dk, generator=gen))
    v = torch.randn(b, s, h, dv, generator=gen)
    # per channel; `strong`: A up to 16 as initialised, so a chunk's cumulative decay reaches e^-1000
    scale = torch.empty(h, 1).uniform_(1.0, 16.0, generator=gen) if strong else 0.5
    g = -F.softplus(torch.randn(b, s, h, dk, generator=gen)) * scale
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("seq", [1, 63, 64, 150])
@pytest.mark.parametrize("strong", [False, True], ids=["mild", "strong-decay"])
def test_per_channel_chunked_and_recurrent_match_float64(seq, strong):
    q, k, v, g, beta = inputs(s=seq, strong=strong)
    initial = torch.randn(2, 3, 8, 12, generator=torch.Generator().manual_seed(1))
    ref_out, ref_state = float64_delta_rule(q, k, v, g, beta, initial)
    for form in (recurrent_delta_rule, chunked_delta_rule):
        out, state = form(q, k, v, g, beta, initial_state=initial)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref_out) < 1e-5 and rel_err(state, ref_state) < 1e-5
    # control: one decay per head (the channel mean) is a different recurrence
    head_out, _ = chunked_delta_rule(q, k, v, g.mean(-1), beta, initial_state=initial)
    assert rel_err(head_out, ref_out) > 1e-3


def test_per_channel_forms_match_transformers_kda_reference():
    from transformers.models.kimi_linear import modeling_kimi_linear as ref

    gen = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 130, 4, 16
    q_raw, k_raw, v = (torch.randn(b, s, h, d, generator=gen) for _ in range(3))
    g = -F.softplus(torch.randn(b, s, h, d, generator=gen))
    beta = torch.rand(b, s, h, generator=gen)
    theirs, their_state = ref.chunk_kimi_delta_attention(q_raw, k_raw, v, g=g, beta=beta, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    q, k = l2_normalize(q_raw) * d**-0.5, l2_normalize(k_raw)
    ours, state = chunked_delta_rule(q, k, v, g, beta)
    assert rel_err(ours, theirs) < 1e-5 and rel_err(state, their_state) < 1e-5
    rec, rec_state = ref.recurrent_kimi_delta_attention(q_raw, k_raw, v, g=g, beta=beta, initial_state=None,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours_rec, our_rec_state = recurrent_delta_rule(q, k, v, g, beta)
    assert rel_err(ours_rec, rec) < 1e-5 and rel_err(our_rec_state, rec_state) < 1e-5


@pytest.mark.parametrize("lengths", [(30, 70, 50), (64, 64, 22), (1, 100, 1, 48)])
def test_per_channel_packed_documents_match_each_document_alone(lengths):
    q, k, v, g, beta = inputs(b=1, s=sum(lengths))
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    alone, start = [], 0
    for n in lengths:
        out, last_state = float64_delta_rule(*(t[:, start:start + n] for t in (q, k, v, g, beta)))
        alone.append(out)
        start += n
    alone = torch.cat(alone, dim=1)
    for form in (chunked_delta_rule, recurrent_delta_rule):
        out, state = form(q, k, v, g, beta, segments=segments)
        assert rel_err(out, alone) < 1e-5 and rel_err(state, last_state) < 1e-5
    leaked, _ = chunked_delta_rule(q, k, v, g, beta)  # control: without segments documents leak
    assert rel_err(leaked, alone) > 1e-2


@pytest.fixture(scope="module")
def debug_model():
    return build(tm.flavor("kimi_linear", "debug"), seed=3).eval()


def test_changing_later_tokens_never_changes_earlier_logits(debug_model):
    tokens = torch.randint(0, 2048, (1, 150), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 100:] = torch.randint(0, 2048, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = debug_model(tokens), debug_model(changed)
    assert torch.equal(a[:, :100], b[:, :100]) or rel_err(a[:, :100], b[:, :100]) < 1e-6
    assert rel_err(a[:, 100:], b[:, 100:]) > 1e-2


def test_packed_documents_give_what_each_document_gives_alone(debug_model):
    lengths = (40, 90, 20)
    tokens = torch.randint(0, 2048, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = debug_model(tokens, context=AttentionContext(document_ids=ids))
        alone = torch.cat([debug_model(part) for part in tokens.split(list(lengths), dim=1)], dim=1)
        leaked = debug_model(tokens)
    assert rel_err(packed, alone) < 1e-5
    assert rel_err(leaked, alone) > 1e-3  # control


def test_both_spellings_of_the_moe_fields_read_as_transformers_resolves_them():
    converter = tm.family("kimi_linear").hf
    written = dict(TINY_HF_CONFIGS["layer-types-groups-q-lora"])
    renames = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
               "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
               "model_max_length": "max_position_embeddings"}
    deepseek = {renames.get(k, k): v for k, v in written.items()} | {"norm_topk_prob": False}
    written |= {"moe_renormalize": False}
    for fields in (written, deepseek):
        ours = converter.config_from_hf(fields, set())
        theirs = transformers.AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "model_type"} |
                                                   {"model_type": "kimi_linear"})
        moe = ours.moe
        assert (moe.num_experts, moe.top_k, moe.n_group, moe.num_shared_experts, moe.norm_topk_prob) == (
            theirs.num_local_experts, theirs.num_experts_per_tok, theirs.n_group, theirs.n_shared_experts,
            theirs.norm_topk_prob)
        assert ours.max_seq_len == theirs.max_position_embeddings and ours.layer_kinds() == tuple(theirs.layer_types)
        assert ours.mlp_kinds() == tuple(theirs.mlp_layer_types)
        assert (ours.linear_num_heads, ours.linear_head_dim, ours.linear_conv_kernel) == (
            theirs.linear_num_heads, theirs.linear_head_dim, theirs.linear_conv_kernel_dim)


def test_release_schedule_is_read_one_indexed():
    fields = dict(TINY_HF_CONFIGS["release-schedule"])
    fields["linear_attn_config"] = dict(fields["linear_attn_config"]) | {"kda_layers": [2, 3, 4],
                                                                         "full_attn_layers": [1]}
    ours = tm.family("kimi_linear").hf.config_from_hf(fields, set())
    theirs = transformers.AutoConfig.for_model(**fields)
    assert ours.layer_kinds() == tuple(theirs.layer_types) == (
        "full_attention", "linear_attention", "linear_attention", "linear_attention")


@pytest.mark.parametrize(("change", "field"), [
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3]}}, "linear_attn_config"),
    ({"linear_attn_config": {"kda_layers": [0, 1, 2], "full_attn_layers": [3]}}, "linear_attn_config.kda_layers"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_raise_naming_the_field(change, field):
    fields = dict(TINY_HF_CONFIGS["release-schedule"]) | change
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        config = tm.family("kimi_linear").hf.config_from_hf(fields, set())
        with torch.device("meta"):
            config.build()


def test_configs_the_checkpoint_cannot_hold_are_refused():
    import dataclasses

    debug = tm.flavor("kimi_linear", "debug")
    with pytest.raises(ValueError, match="tie_embeddings"):
        tm.family("kimi_linear").hf.config_to_hf(dataclasses.replace(debug, tie_embeddings=True))
    with pytest.raises(ValueError, match="moe must be set"):
        dataclasses.replace(debug, moe=None).build()
    with pytest.raises(ValueError, match="mlp_layer_types"):
        dataclasses.replace(debug, mlp_layer_types=("dense",)).build()


def test_48b_builds_on_meta_in_seconds_and_counts_as_transformers_builds_it():
    import time

    with torch.device("meta"):  # the first build in a process pays a one-off setup (~15 s on a busy CPU)
        tm.flavor("kimi_linear", "debug").build()
    start = time.perf_counter()
    with torch.device("meta"):
        model = tm.flavor("kimi_linear", "48B-A3B").build()
    assert time.perf_counter() - start < 10
    # transformers 5.20's KimiLinearForCausalLM from the release config (linear_attn_config schedule), counted
    # on the meta device: 49,122,675,072 parameters.
    assert tm.count_params(model).total == 49_122_675_072
    assert model.layers["3"].attention.wkv_b.weight.shape == (32 * 256, 512)  # MLA at 1-indexed layer 4
    assert model.layers["0"].attention.decay.dt_bias.shape == (32 * 128,)  # per-channel decay
