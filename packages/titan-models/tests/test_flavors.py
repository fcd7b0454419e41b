"""Flavors: published parameter counts (meta device, counts only), debug models of every family."""
from __future__ import annotations

import time

import pytest
import torch
from tm_reference import build

import titan_models as tm


def within_published(ours: int, published: str) -> bool:
    """Published sizes are rounded to the digits they show ("3.3B", "37B", "8.03B", "1T"): accept a count within
    one unit of the last shown digit, or within 0.5%, whichever is wider."""
    assert published[-1] in "BT", published
    mantissa, scale = published[:-1], 1e9 if published.endswith("B") else 1e12
    value = float(mantissa) * scale
    unit = 10.0 ** -(len(mantissa.split(".")[1]) if "." in mantissa else 0) * scale
    return abs(ours - value) <= max(unit, 0.005 * value)


def test_within_published_tolerance_rule():
    assert within_published(3.35e9, "3.3B") and not within_published(3.45e9, "3.3B")
    assert within_published(671.9e9, "671B") and not within_published(675e9, "671B")  # 0.5% of 671B is wider
    assert within_published(8.07e9, "8.03B") and not within_published(8.09e9, "8.03B")
    assert within_published(1.57e12, "1.6T") and not within_published(1.49e12, "1.6T")


PUBLISHED = [(f.name, flavor) for f in tm.families() for flavor in f.published_sizes]


@pytest.mark.parametrize(("family", "name"), PUBLISHED, ids=[f"{f}-{n}" for f, n in PUBLISHED])
def test_counts_match_published(family, name):
    record = tm.family(family)
    published = record.published_sizes[name]
    total, active = record.count_as_published(tm.count_params(tm.flavor(family, name)))
    assert within_published(total, published.total), (total, published)
    if published.active is not None:
        assert within_published(active, published.active), (active, published)


@pytest.mark.parametrize("family", [f.name for f in tm.families()])
def test_every_flavor_but_the_debug_ones_has_a_published_size(family):
    record = tm.family(family)
    unpublished = [n for n in record.flavors if not n.startswith("debug") and n not in record.published_sizes]
    assert not unpublished, f"{family} flavors {unpublished} have no published size to check their counts against"


def test_llama3_counts_match_exact_hf_checkpoints():
    # sums of the tensor sizes in the released safetensors (tied 1B stores the table once)
    exact = {"1B": 1_235_814_400, "3B": 3_212_749_824, "8B": 8_030_261_248, "70B": 70_553_706_496,
             "405B": 405_853_388_800}
    for name, count in exact.items():
        assert tm.count_params(tm.flavor("llama3", name)).total == count, name


def test_671b_builds_on_meta_in_seconds():
    config = tm.flavor("deepseek_v3", "671B")
    start = time.perf_counter()
    with torch.device("meta"):
        model = config.build()
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"building took {elapsed:.1f}s"
    assert all(p.is_meta for p in model.parameters())
    counts = tm.count_params(model)
    assert counts.mtp > 11e9 and model.mtp is not None  # one MoE block + eh_proj
    assert len(model.layers) == 61 and model.layers["2"].feed_forward is not None and model.layers["3"].moe is not None
    assert model.layers["3"].moe.experts.w1.shape == (256, 2048, 7168)


@pytest.mark.parametrize("family", [f.name for f in tm.families()])
def test_every_family_has_a_tiny_debug_flavor(family):
    config = tm.flavor(family, "debug")
    assert config.dim <= 256 and 4 <= config.num_layers <= 6 and config.vocab_size >= 264
    assert tm.count_params(config).total < 10e6


DEBUG = [(f.name, flavor) for f in tm.families() for flavor in f.flavors if flavor.startswith("debug")]


@pytest.mark.parametrize(("family", "name"), DEBUG, ids=[f"{f}-{n}" for f, n in DEBUG])
def test_debug_models_agree_across_attention_backends_and_train(family, name):
    config = tm.transforms.num_layers(2)(tm.flavor(family, name))
    sdpa, flex = build(tm.transforms.attention("sdpa")(config)), build(tm.transforms.attention("flex")(config))
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    with torch.no_grad():
        for context in (None, tm.AttentionContext(document_ids=doc_ids)):
            assert torch.allclose(flex(tokens, context=context), sdpa(tokens, context=context), atol=2e-5)
    loss = sdpa(tokens).logsumexp(-1).mean()
    loss.backward()
    # a text-only call reaches every parameter but MTP's and a vision tower's (test_qwen3_vl_hf.py trains with images)
    assert all(p.grad is not None for n, p in sdpa.named_parameters() if "mtp" not in n and not n.startswith("visual."))


def test_flops_per_token_uses_the_attention_head_dims():
    config = tm.flavor("deepseek_v3", "671B")
    counts = tm.count_params(config)
    seq = 4096
    attention = 6 * seq * 61 * 128 * (192 + 128)  # MLA: qk head 128 + 64, v head 128
    assert tm.flops_per_token(config, seq) == 6 * (counts.active - counts.embedding) + attention
    assert tm.flops_per_token(config, seq, include_mtp=True) > tm.flops_per_token(config, seq)


def test_gpt_oss_flops_count_sliding_windows():
    config = tm.flavor("gpt_oss", "20b")
    counts = tm.count_params(config)
    seq = 4096
    per_key = 6 * 64 * (64 + 64)  # 64 heads, qk and v head dims 64
    attention = per_key * (12 * seq + 12 * 128)  # 12 full layers, 12 sliding ones seeing 128 keys
    assert tm.flops_per_token(config, seq) == 6 * (counts.active - counts.embedding) + attention
    assert tm.flops_per_token(config, 64) == 6 * (counts.active - counts.embedding) + per_key * 24 * 64


def test_flops_per_token_counts_linear_attention_without_seq_len():
    config = tm.flavor("qwen3_5", "35B-A3B")
    counts = tm.count_params(config)
    kinds = config.layer_kinds()
    full, linear = kinds.count("full_attention"), kinds.count("linear_attention")
    assert (full, linear) == (10, 30)
    softmax = 6 * 4096 * full * 16 * (256 + 256)  # 16 heads of 256, not the 64 rotated channels
    delta_rule = 6 * linear * 32 * (64 * (3 * 128 + 2 * 128) + 3 * 128 * 128)  # 32 value heads, chunk 64
    matmuls = 6 * (counts.active - counts.embedding)
    assert tm.flops_per_token(config, 4096) == matmuls + softmax + delta_rule
    longer = tm.flops_per_token(config, 32768) - tm.flops_per_token(config, 4096)
    assert longer == 6 * (32768 - 4096) * full * 16 * 512  # only the full-attention layers grow with seq_len
