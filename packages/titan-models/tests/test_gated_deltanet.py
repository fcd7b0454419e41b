"""Gated DeltaNet: chunked and recurrent forms against a float64 recurrence and transformers'
reference functions; packed documents against each document alone; carried decode state."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tm_delta_rule_reference import float64_delta_rule
from tm_reference import rel_err

from titan_models.components.gated_deltanet import (
    GatedDeltaNetConfig, causal_conv, chunked_delta_rule, l2_normalize, recurrent_delta_rule,
)
from titan_models.context import AttentionContext


def inputs(b=2, s=150, h=3, dk=8, dv=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, s, h, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(b, s, h, dk, generator=gen))
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -F.softplus(torch.randn(b, s, h, generator=gen)) * 0.5
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("seq", [1, 63, 64, 150])
def test_chunked_and_recurrent_match_float64(seq):
    q, k, v, g, beta = inputs(s=seq)
    initial = torch.randn(2, 3, 8, 12, generator=torch.Generator().manual_seed(1))
    ref_out, ref_state = float64_delta_rule(q, k, v, g, beta, initial)
    for form in (recurrent_delta_rule, lambda *a, **kw: chunked_delta_rule(*a, **kw, chunk_size=64)):
        out, state = form(q, k, v, g, beta, initial_state=initial)
        assert rel_err(out, ref_out) < 1e-5 and rel_err(state, ref_state) < 1e-5


def test_chunked_matches_transformers_reference_functions():
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    gen = torch.Generator().manual_seed(3)
    b, s, h, dk, dv = 2, 130, 4, 16, 8
    q_raw, k_raw, v = (torch.randn(b, s, h, d, generator=gen) for d in (dk, dk, dv))
    g = -F.softplus(torch.randn(b, s, h, generator=gen))
    beta = torch.rand(b, s, h, generator=gen)
    theirs, their_state = ref.torch_chunk_gated_delta_rule(q_raw, k_raw, v, g=g, beta=beta, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    q, k = l2_normalize(q_raw) * dk**-0.5, l2_normalize(k_raw)
    ours, state = chunked_delta_rule(q, k, v, g, beta)
    assert rel_err(ours, theirs) < 1e-5 and rel_err(state, their_state) < 1e-5
    rec, rec_state = ref.torch_recurrent_gated_delta_rule(q_raw, k_raw, v, g=g, beta=beta, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    assert rel_err(ours, rec) < 1e-5


def _segments(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


@pytest.mark.parametrize("lengths", [(30, 70, 50), (64, 64, 22), (1, 100, 1, 48)])
def test_packed_documents_match_each_document_alone(lengths):
    q, k, v, g, beta = inputs(b=1, s=sum(lengths))
    segments = _segments(lengths)
    packed = {name: form(q, k, v, g, beta, segments=segments)
              for name, form in (("chunked", chunked_delta_rule), ("recurrent", recurrent_delta_rule))}
    start = 0
    alone_outs = []
    for n in lengths:
        part = [t[:, start:start + n] for t in (q, k, v, g, beta)]
        alone_outs.append(float64_delta_rule(*part)[0])
        last_state = float64_delta_rule(*part)[1]
        start += n
    alone = torch.cat(alone_outs, dim=1)
    for name, (out, state) in packed.items():
        assert rel_err(out, alone) < 1e-5, name
        assert rel_err(state, last_state) < 1e-5, name  # the state after the last document only
    # control: without the segments the documents leak into each other
    leaked, _ = chunked_delta_rule(q, k, v, g, beta)
    assert rel_err(leaked, alone) > 1e-2


def test_conv_resets_at_documents_and_carries_history():
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(1, 20, 6, generator=gen), torch.randn(6, 1, 4, generator=gen)
    reference = F.silu(F.conv1d(x.transpose(1, 2), weight, padding=3, groups=6)[..., :20]).transpose(1, 2)
    out, _ = causal_conv(x, weight, None, None)
    assert rel_err(out, reference) < 1e-6
    segments = _segments((7, 13))
    packed, history = causal_conv(x, weight, None, segments)
    second, second_history = causal_conv(x[:, 7:], weight, None, None)
    assert rel_err(packed[:, :7], reference[:, :7]) < 1e-6 and rel_err(packed[:, 7:], second) < 1e-6
    assert torch.equal(history, second_history)
    head, h = causal_conv(x[:, :11], weight, None, None)  # split in two calls carrying the history
    tail, _ = causal_conv(x[:, 11:], weight, h, None)
    assert rel_err(torch.cat([head, tail], dim=1), reference) < 1e-6


def _layer(seed=0):
    layer = GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6).build(32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def test_layer_packed_documents_and_decode_state():
    layer = _layer()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 140, 32, generator=gen)
    with torch.no_grad():
        full = layer(x)
        ids = _segments((90, 50))
        packed = layer(x, context=AttentionContext(document_ids=ids))
        assert rel_err(packed[:, :90], full[:, :90]) < 1e-6
        assert rel_err(packed[:, 90:], layer(x[:, 90:])) < 1e-5
        # prefill 100 tokens, then decode 40 one at a time, carrying the state
        states: dict = {}
        pieces = [layer(x[:, :100], context=AttentionContext(recurrent_states=states))]
        for t in range(100, 140):
            pieces.append(layer(x[:, t:t + 1], context=AttentionContext(recurrent_states=states)))
        assert rel_err(torch.cat(pieces, dim=1), full) < 1e-5
        assert states[layer].recurrent.shape == (1, 4, 8, 6) and states[layer].conv.shape == (1, 3, 2 * 16 + 24)


def test_bad_head_counts_raise():
    with pytest.raises(ValueError, match="num_value_heads"):
        GatedDeltaNetConfig(num_key_heads=3, num_value_heads=4, key_head_dim=8, value_head_dim=8).build(16)


def test_right_padding_leaves_the_state_at_the_last_valid_token():
    layer = _layer(seed=2)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 75, 32, generator=gen)
    lengths = torch.tensor([75, 2])
    valid = torch.arange(75)[None] < lengths[:, None]
    with torch.no_grad():
        states: dict = {}
        layer(x, context=AttentionContext(recurrent_states=states, valid_tokens=valid))
        step = torch.randn(2, 1, 32, generator=gen)
        after = layer(step, context=AttentionContext(recurrent_states=states))
        for row, n in enumerate(lengths.tolist()):
            whole = layer(torch.cat([x[row:row + 1, :n], step[row:row + 1]], dim=1))
            assert rel_err(after[row], whole[0, -1:]) < 1e-5, row



def test_the_delta_rule_runs_without_autocast(monkeypatch):
    import titan_models.components.gated_deltanet as gdn

    seen = []
    for name in ("chunked_delta_rule", "recurrent_delta_rule"):
        original = getattr(gdn, name)

        def recording(*args, _original=original, **kwargs):
            seen.append(torch.is_autocast_enabled("cpu"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(gdn, name, recording)
    layer = _layer(seed=3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(1, 70, 32))  # chunked
        layer(torch.randn(1, 1, 32))  # recurrent
    assert out.dtype == torch.bfloat16  # the projections around it follow autocast
    assert seen == [False, False]  # the triangular solve and state products stay float32
