"""Muse Glimmer and Muse Spark beyond the registry-driven parity cases: the tanh softcap exercised in its
curved range both ways, MoE routing with the selection bias, bad configs, flavors on the meta device."""
from __future__ import annotations

import time

import pytest
import torch
import transformers
from tm_reference import build, load_hf, rel_err, save_hf

import titan_models as tm

SEQ = 80  # > 64 tokens, ten times the tiny sliding window of 8
CASES = [("muse_glimmer", "composite"), ("muse_spark", "composite")]


def _hf_config(family: str, case: str, **text):
    fields = dict(tm.family(family).tiny_hf_configs[case].config)
    fields["text_config"] = dict(fields["text_config"]) | text
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _curved(logits: torch.Tensor, cap: float) -> float:
    """Fraction of logits where tanh is far from linear (|logit| > cap / 2: tanh(x) < 0.93 x there)."""
    return (logits.abs() > cap / 2).float().mean().item()


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f for f, _ in CASES])
def test_from_hf_matches_in_the_softcaps_curved_range(tmp_path, family, case):
    tiny = tm.family(family).tiny_hf_configs[case]
    reference = save_hf(_hf_config(family, case), tmp_path, auto_class=tiny.auto_class, prepare=tiny.prepare)
    model = tm.from_hf(tmp_path)
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens).logits
        assert _curved(expected, model.config.logit_softcap) > 0.3  # the cap shapes the logits
        assert rel_err(model(tokens), expected) < 1e-5
        model.logit_softcap = None  # control: without the cap (scale kept) the logits are far off
        assert rel_err(model(tokens), expected) > 0.1


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f for f, _ in CASES])
def test_to_hf_matches_in_the_softcaps_curved_range(tmp_path, family, case):
    record = tm.family(family)
    config = record.hf.config_from_hf(dict(record.tiny_hf_configs[case].config), set())
    model = build(config, seed=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "residual" in name or "expert_bias" in name:
                param.uniform_(-0.5, 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.uniform_(-0.05, 0.05)
        model.output.weight.mul_(80.0)
    tm.to_hf(model, tmp_path)
    reference = load_hf(tmp_path, auto_class="AutoModelForImageTextToText")
    tokens = _tokens(config.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
        assert _curved(ours, config.logit_softcap) > 0.3
        assert rel_err(reference(tokens).logits, ours) < 1e-5


def test_muse_spark_routes_over_many_experts_with_the_loaded_selection_bias(tmp_path):
    tiny = tm.family("muse_spark").tiny_hf_configs["composite"]
    reference = save_hf(_hf_config("muse_spark", "composite"), tmp_path, auto_class=tiny.auto_class)
    model = tm.from_hf(tmp_path)
    bias = reference.model.language_model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(model.layers["1"].moe.expert_bias, bias) and bias.abs().sum() > 0
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        model(tokens)
        counts = model.layers["2"].moe.tokens_per_expert
        assert (counts > 0).sum() >= 6 and counts.sum() == 2 * SEQ * 2  # top-2 of 8, most experts used
        expected = reference(tokens).logits
        model.layers["2"].moe.expert_bias.add_(torch.linspace(-1, 1, 8))  # control: selection bias matters
        assert rel_err(model(tokens), expected) > 1e-3


@pytest.mark.parametrize(("field", "value"), [
    ("layer_types", ["sliding_attention"] * 3), ("layer_types", ["local"] * 4), ("layer_rope_theta", [0.0]),
    ("final_logit_softcapping", 0.0), ("mlp_layer_types", ["moe"] * 4), ("attention_bias", True),
])
def test_bad_hf_configs_raise_naming_the_field(field, value):
    record = tm.family("muse_spark")
    hf = dict(record.tiny_hf_configs["composite"].config)
    hf["text_config"] = dict(hf["text_config"]) | {field: value}
    with pytest.raises(ValueError, match=field):
        record.hf.config_from_hf(hf, set())


@pytest.mark.parametrize(("family", "field", "value"), [
    ("muse_glimmer", "nope_layers", (7,)), ("muse_glimmer", "sliding_window", 0),
    ("muse_glimmer", "qk_scale_factor", -1.0), ("muse_glimmer", "layer_types", ("full_attention",)),
    ("muse_spark", "mlp_layer_types", ("sparse", "dense")), ("muse_spark", "residual_gate_temperature", 0.0),
])
def test_bad_configs_raise_naming_the_field(family, field, value):
    import dataclasses

    config = dataclasses.replace(tm.flavor(family, "debug"), **{field: value})
    with pytest.raises(ValueError, match=field):
        with torch.device("meta"):
            config.build()


def test_text_parameter_counts_equal_transformers():
    # transformers 5.20's default composite configs counted on the meta device, text model + lm_head only
    assert tm.count_params(tm.flavor("muse_glimmer", "30B")).total == 27_854_780_928
    assert tm.count_params(tm.flavor("muse_spark", "816B-A42B")).total == 819_990_536_192


@pytest.mark.parametrize(("family", "name"), [("muse_glimmer", "30B"), ("muse_spark", "816B-A42B")])
def test_published_flavors_build_on_meta_in_seconds(family, name):
    start = time.perf_counter()
    with torch.device("meta"):
        model = tm.flavor(family, name).build()
    assert time.perf_counter() - start < 10
    assert len(model.layers) == tm.flavor(family, name).num_layers
