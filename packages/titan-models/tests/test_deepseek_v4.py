"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (fp32, 80 tokens, 0-based positions: the
reference counts compressor windows from the forward's first token), both ways and from the release's
un-prefixed layout; causality for shifted starts and packed documents (where ours departs from the
reference on purpose); config errors name the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import titan_models as tm
from titan_models.context import AttentionContext
from titan_models.hf.convert import read_config
from titan_models.models.deepseek_v4.hf import TINY_HF_CONFIGS

transformers = pytest.importorskip("transformers")

SEQ = 80  # > 64; 20 sparse entries (rate 4) and 10 heavy ones (rate 8): index_topk 64 keeps every visible one


def _reference(seed: int = 0):
    config = transformers.AutoConfig.for_model(**TINY_HF_CONFIGS["every-attention-kind"].config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # move every parameter off its init (zero sinks / ape / hc bases, unit scales) so each one matters
            param.add_(torch.randn_like(param) * (0.5 if name.endswith(("sinks", "position_bias", "base")) else 0.05))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):  # all zeros after init: give each token distinct experts
                vocab, k = gate.tid2eid.shape
                gate.tid2eid.copy_(torch.stack([torch.randperm(config.n_routed_experts)[:k] for _ in range(vocab)]))
            else:
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.1)
    return model


def _tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_from_hf_matches_transformers(tmp_path):
    reference = _reference()
    reference.save_pretrained(tmp_path)
    model = tm.from_hf(tmp_path).eval()
    tokens = _tokens()
    with torch.no_grad():
        want = reference(tokens).logits
        got = model(tokens)
    assert _rel(got, want) < 1e-5
    kinds = model.config.resolved_layer_types
    assert set(kinds) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert model.config.resolved_mlp_layer_types[0] == "hash_moe"
    # the hash table loaded (not the fixed default): routing follows the checkpoint's table
    assert torch.equal(model.layers["0"].moe.tid2eid, reference.model.layers[0].mlp.gate.tid2eid)


def test_to_hf_loads_in_transformers(tmp_path):
    model = tm.from_hf(_save(_reference(seed=3), tmp_path / "src")).eval()
    tm.to_hf(model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = _tokens(seed=4)
    with torch.no_grad():
        assert _rel(model(tokens), reloaded(tokens).logits) < 1e-5


def test_titan_initialised_model_round_trips_through_transformers(tmp_path):
    model = tm.flavor("deepseek_v4", "debug").build()
    model.init_weights(seed=0)
    with torch.no_grad():  # non-trivial sinks / ape so the written values matter
        for name, param in model.named_parameters():
            if name.endswith(("sinks.weight", "ape")):
                param.normal_(0, 0.5)
    tm.to_hf(model, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 2048, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _rel(model(tokens), reference(tokens).logits) < 1e-5


def _save(model, folder):
    model.save_pretrained(folder)
    return folder


def test_release_layout_loads(tmp_path):
    """DeepSeek's release names: no `model.` prefix, embed / norm / hc_head_* at the top, MTP under mtp.*."""
    reference = _reference(seed=5)
    _save(reference, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    release = {top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
    release["mtp.0.hc_head_fn"] = torch.zeros(2, 64)  # an MTP tensor the config does not declare: reported
    (tmp_path / "release").mkdir()
    save_file(release, tmp_path / "release" / "model.safetensors")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "release" / "config.json").write_text(json.dumps(hf | {"num_nextn_predict_layers": 0}))
    with pytest.warns(UserWarning, match="mtp"):
        model = tm.from_hf(tmp_path / "release").eval()
    tokens = _tokens(seed=6)
    with torch.no_grad():
        assert _rel(model(tokens), reference(tokens).logits) < 1e-5


def _mtp_model(seed: int = 0):
    import dataclasses

    model = dataclasses.replace(tm.flavor("deepseek_v4", "debug"), mtp=True).build()
    model.init_weights(seed=seed)
    with torch.no_grad():  # off the unit / zero inits, so every MTP tensor matters
        for name, param in model.mtp.named_parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def _rms(x, weight, eps=1e-6):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_mtp_module_wiring_by_hand():
    """h' = layer(h_proj(hnorm(streams)) + e_proj(enorm(embed(t[i+1])))), then norm(hc_head(h')): the inputs
    combined by hand (float64 norms and projections) from the main model's last streams; the block and the
    head collapse are the model's own (checked against transformers in the main model)."""
    model = _mtp_model()
    mtp = model.mtp
    tokens = torch.randint(0, 2048, (2, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, mtp_logits = model.forward_with_mtp(tokens)
        streams, ropes, positions = model._streams(tokens, None, None)
        embedded = model.tok_embeddings(tokens.roll(-1, dims=1))
        h = (_rms(streams, mtp.hnorm.weight) @ mtp.h_proj.weight.double().T
             + (_rms(embedded, mtp.enorm.weight) @ mtp.e_proj.weight.double().T).unsqueeze(2)).float()
        h = mtp.layer(h, ropes, positions=positions, token_ids=None, entry_rope=model.compress_rope)
        want = _rms(mtp.hc_head(h), mtp.norm.weight) @ model.output.weight.double().T
        assert _rel(mtp_logits.double(), want) < 1e-5
        assert torch.equal(logits, model(tokens))  # the main logits are the plain forward's


def test_mtp_is_causal():
    """MTP position i reads token i + 1: changing tokens from j on leaves mtp_logits before j - 1 alone."""
    model = _mtp_model()
    tokens = torch.randint(0, 2048, (1, 96), generator=torch.Generator().manual_seed(4))
    changed = tokens.clone()
    changed[:, 50:] = torch.randint(0, 2048, (1, 46), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = model.forward_with_mtp(tokens)[1], model.forward_with_mtp(changed)[1]
    assert torch.allclose(a[:, :49], b[:, :49], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 49], b[:, 49], atol=1e-3)  # control: position 49 reads token 50


def test_mtp_round_trips_in_both_layouts_and_transformers_ignores_it(tmp_path):
    """to_hf writes the module as model.mtp.0.* (DeepSeek's names); from_hf reads it back from that folder and
    from the release layout (mtp.0.*, no model. prefix); transformers loads the folder and drops the module."""
    model = _mtp_model(seed=1)
    tm.to_hf(model, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert {"model.mtp.0.e_proj.weight", "model.mtp.0.h_proj.weight", "model.mtp.0.hc_head_fn",
            "model.mtp.0.attn.wq_a.weight", "model.mtp.0.ffn.gate.bias", "model.mtp.0.hc_attn_fn",
            "model.mtp.0.ffn.experts.7.w2.weight"} <= set(tensors)
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    (tmp_path / "release").mkdir()
    save_file({top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()},
              tmp_path / "release" / "model.safetensors")
    (tmp_path / "release" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    want = model.state_dict()
    for folder in ("hf", "release"):
        loaded = tm.from_hf(tmp_path / folder)
        assert loaded.config.mtp and set(loaded.state_dict()) == set(want)
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, want[name]), (folder, name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 2048, (2, 80), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert _rel(model(tokens), reference(tokens).logits) < 1e-5


def test_prefill_then_decode_equals_one_forward():
    """The decode state (recurrent_states: each layer's inputs and keys=values by slot) gives, token by token,
    the full forward's logits at every attention kind (heavy, then sparse with the indexer), past the 16-token
    window and across window completions (rates 4 and 16). index_topk 64 >= the entries: no indexer ties."""
    import dataclasses

    model = dataclasses.replace(tm.flavor("deepseek_v4", "debug"), index_topk=64).build()
    model.init_weights(seed=0)
    model.eval()
    assert set(model.config.resolved_layer_types) == {"heavily_compressed_attention", "compressed_sparse_attention"}
    tokens = torch.randint(0, 2048, (2, 96), generator=torch.Generator().manual_seed(7))
    prefill = 70  # decode completes heavy entries at 79 and 95, sparse ones every 4 tokens
    states: dict = {}
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :prefill], positions=torch.arange(prefill).expand(2, prefill),
                       context=AttentionContext(recurrent_states=states))]
        for t in range(prefill, 96):
            steps.append(model(tokens[:, t:t + 1], positions=torch.full((2, 1), t),
                               context=AttentionContext(recurrent_states=states)))
    assert _rel(torch.cat(steps, dim=1), full) < 1e-5
    with pytest.raises(ValueError, match="packed documents"):
        model(tokens, context=AttentionContext(recurrent_states={}, document_ids=torch.zeros_like(tokens)))


def _debug_model():
    model = tm.flavor("deepseek_v4", "debug").build()
    model.init_weights(seed=0)
    return model.eval()


@pytest.mark.parametrize("start", [0, 3, 37])
def test_later_tokens_never_change_earlier_logits(start):
    model = _debug_model()
    tokens = torch.randint(0, 2048, (1, 96), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 50:] = torch.randint(0, 2048, (1, 46), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(start, start + 96)[None]
    with torch.no_grad():
        a, b = model(tokens, positions=positions), model(changed, positions=positions)
    assert torch.allclose(a[:, :50], b[:, :50], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 50:], b[:, 50:], atol=1e-3)  # control: the later logits do move


def test_packed_documents_equal_each_document_alone():
    model = _debug_model()
    tokens = torch.randint(0, 2048, (1, 96), generator=torch.Generator().manual_seed(2))
    cut = 41  # not a window boundary of either rate
    positions = torch.cat([torch.arange(cut), torch.arange(96 - cut)])[None]
    document_ids = torch.cat([torch.zeros(cut), torch.ones(96 - cut)]).long()[None]
    with torch.no_grad():
        packed = model(tokens, positions=positions, context=AttentionContext(document_ids=document_ids))
        first = model(tokens[:, :cut])
        second = model(tokens[:, cut:])
    assert torch.allclose(packed[:, :cut], first, rtol=0, atol=1e-5)
    assert torch.allclose(packed[:, cut:], second, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("field", "value"), [("layer_types", ("sliding_attention",) * 3),
                                              ("mlp_layer_types", ("dense",) * 4), ("o_groups", 3),
                                              ("compress_rates", {"compressed_sparse_attention": 4}),
                                              ("hc_mult", 0)])
def test_bad_configs_name_the_field(field, value):
    import dataclasses
    config = dataclasses.replace(tm.flavor("deepseek_v4", "debug"), **{field: value})
    with pytest.raises(ValueError, match=field):
        with torch.device("meta"):
            config.build()


def test_config_json_round_trip(tmp_path):
    _reference().save_pretrained(tmp_path)
    config = read_config(tmp_path)
    written = tm.family("deepseek_v4").hf.config_to_hf(config)
    hf = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "index_topk", "o_groups", "hc_mult"):
        assert written[key] == hf[key], key
    assert written["rope_parameters"]["compress"]["attention_factor"] == 1.0


def test_flops_count_the_window_and_the_entries_read():
    config = tm.flavor("deepseek_v4", "debug")  # window 16, rates 4 (top-8 indexer) and 16
    counts = tm.count_params(config)
    seq, kinds = 256, config.resolved_layer_types
    per_key = 6 * 4 * (64 + 64)  # 4 query heads over the shared 64-wide key=value head
    keys = {"sliding_attention": 16, "compressed_sparse_attention": 16 + 8,  # top-8 of 64 entries
            "heavily_compressed_attention": 16 + 256 // 16}
    want = 6 * (counts.active - counts.embedding) + per_key * sum(keys[k] for k in kinds)
    assert tm.flops_per_token(config, seq) == want


@pytest.mark.parametrize(("field", "value"), [("layer_types", ["sliding_attention"]),
                                              ("mlp_layer_types", ["hash_moe", "dense", "moe", "moe"])])
def test_bad_config_json_names_the_field(tmp_path, field, value):
    _reference().save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {field: value}))
    with pytest.raises(ValueError, match=f"config.json field {field}"):
        read_config(tmp_path)
