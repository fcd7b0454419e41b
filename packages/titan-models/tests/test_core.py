"""The model contract of docs/conventions.md: build on meta, init, forward options, pipeline
stages, attention backends and document masks, transforms, override, plan, counts."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from tm_reference import build

import titan_models as tm


@pytest.fixture
def config():
    return tm.transforms.num_layers(2)(tm.flavor("llama3", "debug"))


def test_debug_flavor_fits_a_byte_tokenizer_and_builds_on_meta():
    config = tm.flavor("llama3", "debug")
    assert config.vocab_size >= 256 + 8 and config.num_layers in range(4, 7)
    with torch.device("meta"):
        model = config.build()
    assert all(p.is_meta for p in model.parameters())
    assert list(model.layers) == [str(i) for i in range(config.num_layers)]
    assert isinstance(model.layers, nn.ModuleDict)


def test_flavor_returns_independent_copies_and_rejects_unknown_names():
    a = tm.flavor("llama3", "debug")
    a.dim = 7
    assert tm.flavor("llama3", "debug").dim == 256
    with pytest.raises(ValueError, match="unknown llama3 flavor 'nope'"):
        tm.flavor("llama3", "nope")
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        tm.flavor("gpt2", "debug")
    with pytest.raises(TypeError):
        tm.llama3.Llama3Config(2048, 256)  # keyword-only


def test_init_weights_is_deterministic_and_independent_of_other_layers(config):
    a, b, c = build(config, seed=5), build(config, seed=5), build(config, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # a pipeline stage keeping only layer 1 gets the same layer-1 weights as the full model
    with torch.device("meta"):
        stage = config.build()
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=5)
    for name, param in stage.named_parameters():
        assert torch.equal(param, a.get_parameter(name)), name


def test_init_scheme_norms_ones_and_depth_scaled_residual_projections(config):
    model = build(config)
    assert torch.equal(model.layers["0"].attention_norm.weight, torch.ones(config.dim))
    wq, wo = model.layers["0"].attention.wq.weight, model.layers["0"].attention.wo.weight
    assert wo.std() < 0.7 * wq.std()  # 0.02 / sqrt(2 * layers) vs 0.02
    assert abs(wq.std().item() - 0.02) < 0.002


def test_pipeline_stages_compose_to_the_full_model(config):
    model = build(config)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    with torch.device("meta"):
        first, last = config.build(), config.build()
    first.to_empty(device="cpu"), last.to_empty(device="cpu")
    first.load_state_dict(model.state_dict()), last.load_state_dict(model.state_dict())
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 12, config.dim)
        assert torch.equal(last(hidden), model(tokens))
        assert torch.equal(model.output(model.hidden_states(tokens)), model(tokens))


def test_tied_embeddings_survive_meta_build_and_dtype_moves(config):
    config = dataclasses.replace(config, tie_embeddings=True)
    model = build(config)
    assert model.output.weight is model.tok_embeddings.weight
    model.to(torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.rope.inv_freq.dtype == torch.float32 and model.tok_embeddings.weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))


def test_dtype_transform_builds_bf16_parameters_with_fp32_rope(config):
    model = build(tm.transforms.dtype(torch.bfloat16)(config))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.inv_freq.dtype == torch.float32
    fresh = build(config)
    assert torch.equal(model.rope.inv_freq, fresh.rope.inv_freq)


def test_document_mask_isolates_documents_in_both_backends(config):
    sdpa = build(config)
    flex = build(tm.transforms.attention("flex")(config))
    tokens = torch.randint(0, config.vocab_size, (2, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 12 + [1] * 8])
    positions = torch.cat([torch.arange(7), torch.arange(13)]).expand(2, 20).clone()
    positions[1] = torch.cat([torch.arange(12), torch.arange(8)])
    with torch.no_grad():
        ctx = tm.AttentionContext(document_ids=doc_ids)
        packed = sdpa(tokens, positions=positions, context=ctx)
        # each document alone gives the same logits as inside the pack
        for row, cut in ((0, 7), (1, 12)):
            alone_a = sdpa(tokens[row : row + 1, :cut])
            alone_b = sdpa(tokens[row : row + 1, cut:])
            assert torch.allclose(packed[row, :cut], alone_a[0], atol=1e-5)
            assert torch.allclose(packed[row, cut:], alone_b[0], atol=1e-5)
        flexed = flex(tokens, positions=positions, context=tm.AttentionContext(document_ids=doc_ids))
        assert torch.allclose(flexed, packed, atol=1e-5)
        assert torch.allclose(flex(tokens), sdpa(tokens), atol=1e-5)


def test_flex_backend_trains_on_cpu(config):
    model = build(tm.transforms.attention("flex")(config))
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    model(tokens, context=tm.AttentionContext(document_ids=torch.zeros(1, 8, dtype=torch.long))).sum().backward()
    assert model.layers["0"].attention.wq.weight.grad is not None


def test_transforms_compose_and_reject_missing_fields(config):
    changed = tm.transforms.compose(tm.transforms.num_layers(1), tm.transforms.attention("flex"),
                                    tm.transforms.norm("layernorm", eps=1e-3),
                                    tm.transforms.dtype(torch.float64))(config)
    assert (changed.num_layers, changed.attention, changed.dtype) == (1, "flex", torch.float64)
    assert changed.norm == tm.components.norms.LayerNormConfig(eps=1e-3)
    assert config.num_layers == 2  # the input is untouched
    model = build(changed)
    assert isinstance(model.layers["0"].attention_norm, nn.LayerNorm)
    assert isinstance(model.layers["0"].attention.inner, tm.components.attention.FlexAttention)
    with pytest.raises(ValueError, match="no MoE layers"):
        tm.transforms.moe(implementation="loop")(config)
    with pytest.raises(ValueError, match="unknown attention backend"):
        tm.transforms.attention("flash9")
    with pytest.raises(TypeError):
        tm.transforms.dtype(torch.int32)


def test_override_replaces_matching_modules_and_keeps_weights(config):
    model = build(config)
    tokens = torch.randint(0, config.vocab_size, (1, 10))
    with torch.no_grad():
        before = model(tokens)
    seen = []

    class CountingAttention(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v, *, context=None):
            seen.append(q.shape)
            return self.inner(q, k, v, context=context)

    replaced = tm.override(model, "layers.*.attention.inner", lambda fqn, old: CountingAttention(old))
    assert replaced == ["layers.0.attention.inner", "layers.1.attention.inner"]
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
    assert len(seen) == 2


def test_override_errors_name_the_problem(config):
    model = build(config)
    with pytest.raises(ValueError, match="matches no module"):
        tm.override(model, "layers.*.moe", lambda fqn, old: old)
    with pytest.raises(ValueError, match=r"changes its interface: missing \['w3.weight'\]"):
        tm.override(model, "layers.*.feed_forward", lambda fqn, old: _TwoMatrixFFN(config.dim, config.ffn_dim))
    with pytest.raises(ValueError, match="shape changes"):
        tm.override(model, "layers.*.feed_forward",
                    lambda fqn, old: tm.components.ffn.FeedForward(config.dim, config.ffn_dim + 1))
    with pytest.raises(TypeError, match="not an nn.Module"):
        tm.override(model, "norm", lambda fqn, old: None)
    assert isinstance(model.layers["0"].feed_forward, tm.components.ffn.FeedForward)  # nothing half-replaced


def test_override_may_add_parameters_when_asked(config):
    model = build(config)

    class WithAdapter(nn.Module):  # keeps the Linear's weight, adds one parameter
        def __init__(self, old):
            super().__init__()
            self.weight, self.extra = old.weight, nn.Parameter(torch.zeros(2))

    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        tm.override(model, "layers.*.attention.wq", lambda fqn, old: WithAdapter(old))
    replaced = tm.override(model, "layers.*.attention.wq", lambda fqn, old: WithAdapter(old), adds_parameters=True)
    assert len(replaced) == config.num_layers and "layers.0.attention.wq.extra" in model.state_dict()
    with pytest.raises(ValueError, match=r"missing \['w3.weight'\]"):  # dropping one is still refused
        tm.override(model, "layers.*.feed_forward", lambda fqn, old: _TwoMatrixFFN(config.dim, config.ffn_dim),
                    adds_parameters=True)


class _TwoMatrixFFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


@pytest.mark.parametrize(("family", "name", "mtp"), [("llama3", "debug", False), ("qwen3", "debug", False),
                                                     ("qwen3", "debug_moe", False), ("deepseek_v3", "debug", True),
                                                     ("gpt_oss", "debug", False)])
def test_parallel_plan_names_real_modules(family, name, mtp):
    from titan_models.override import _matches

    config = tm.flavor(family, name)
    if mtp:
        config = dataclasses.replace(config, mtp=True)
    with torch.device("meta"):
        model = config.build()
    plan = model.parallel_plan
    modules = dict(model.named_modules())
    for pattern, style in plan.tensor_parallel.items():
        matched = [m for n, m in modules.items() if _matches(pattern, n)]
        assert matched, pattern
        if style in ("colwise", "rowwise", "output"):
            assert all(isinstance(m, nn.Linear) for m in matched), pattern
    for pattern in plan.experts:
        assert all(isinstance(m, tm.components.moe.GroupedExperts) for n, m in modules.items() if _matches(pattern, n))
    assert bool(plan.moe) == any(isinstance(m, tm.components.moe.MoE) for m in modules.values())
    assert plan.pipeline_cut_points == tuple(f"layers.{i}" for i in range(1, config.num_layers))
    assert any(_matches(plan.activation_checkpoint_unit, n) for n in modules)


def test_param_count_and_flops_formula(config):
    model = build(config)
    counts = tm.count_params(model)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.active == counts.total and counts.embedding == config.vocab_size * config.dim
    seq = 128
    hd = config.resolved_head_dim
    expected = 6 * (counts.total - counts.embedding) + 12 * config.num_layers * config.num_heads * hd * seq
    assert tm.flops_per_token(model, seq) == expected
    assert tm.count_params(config) == counts  # a config is counted via a meta build


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention is exercised on a CUDA GPU")
def test_compiled_flex_matches_sdpa_on_gpu(config):
    config = tm.transforms.dtype(torch.bfloat16)(config)
    with torch.device("meta"):
        sdpa, flex = config.build(), tm.transforms.attention("flex")(config).build()
    sdpa.to_empty(device="cuda"), flex.to_empty(device="cuda")
    sdpa.init_weights(seed=0), flex.init_weights(seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 256), device="cuda")
    doc_ids = (torch.arange(256, device="cuda") >= 100).long().expand(2, 256)
    with torch.no_grad():
        for context in (None, tm.AttentionContext(document_ids=doc_ids)):
            a, b = flex(tokens, context=context).float(), sdpa(tokens, context=context).float()
            assert (a - b).norm() / b.norm() < 2e-2
    flex(tokens).float().logsumexp(-1).mean().backward()  # compiled backward runs
    assert flex.layers["0"].attention.wq.weight.grad is not None
