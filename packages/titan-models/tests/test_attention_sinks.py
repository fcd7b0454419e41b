"""Sliding windows, attention sinks and document masks in every inner attention, against a float64
loop over queries written from the definition (p_ij = exp(s_ij) / (exp(sink) + sum exp(s_ij')))."""
from __future__ import annotations

import pytest
import torch

from titan_models.components.attention import AttentionConfig, build_inner_attention
from titan_models.components.sinks import fold_sinks
from titan_models.context import AttentionContext

B, S, HQ, HKV, D = 2, 19, 4, 2, 8


def reference(q, k, v, *, scale, window, sinks, document_ids):
    """One query at a time, in float64: the keys it may see, their softmax with the sink."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    groups = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            keys = [j for j in range(i + 1) if (window is None or i - j < window)
                    and (document_ids is None or document_ids[b, i] == document_ids[b, j])]
            for h in range(q.shape[2]):
                logits = torch.stack([q[b, i, h] @ k[b, j, h // groups] * scale for j in keys])
                weights = logits.exp()
                denominator = weights.sum() + (0 if sinks is None else sinks[h].double().exp())
                out[b, i, h] = sum(w * v[b, j, h // groups] for w, j in zip(weights, keys)) / denominator
    return out


def _inputs(seed=0, head_dim=D):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, head_dim, generator=g) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=g) * 2
    docs = torch.tensor([[0] * 7 + [1] * 12, [0] * 3 + [1] * 9 + [2] * 7])
    return q, k, v, sinks, docs


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
def test_inner_attention_matches_reference(backend, window, with_sinks, packed):
    q, k, v, sinks, docs = _inputs()
    sinks = sinks if with_sinks else None
    context = AttentionContext(document_ids=docs) if packed else None
    inner = build_inner_attention(backend, scale=D**-0.5, sliding_window=window)
    with torch.no_grad():
        kwargs = {} if sinks is None else {"sinks": sinks}
        out = inner(q, k, v, context=context, **kwargs)
    expected = reference(q, k, v, scale=D**-0.5, window=window, sinks=sinks,
                         document_ids=docs if packed else None)
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_window_and_sinks_change_the_result():
    """Controls: the reference is sensitive to each feature the test above covers."""
    q, k, v, sinks, docs = _inputs()
    base = reference(q, k, v, scale=D**-0.5, window=None, sinks=None, document_ids=None)
    for kwargs in ({"window": 5, "sinks": None, "document_ids": None},
                   {"window": None, "sinks": sinks, "document_ids": None},
                   {"window": None, "sinks": None, "document_ids": docs}):
        assert (reference(q, k, v, scale=D**-0.5, **kwargs) - base).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_gradients_match_float64_autograd(backend):
    """Training on CPU (flex falls back to the dense paths there): gradients of q, k, v and sinks."""
    q, k, v, sinks, docs = _inputs(1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    inner = build_inner_attention(backend, scale=D**-0.5, sliding_window=6)
    inner(*leaves[:3], context=AttentionContext(document_ids=docs), sinks=leaves[3]).square().sum().backward()
    ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v, sinks)]
    reference(*ref_leaves[:3], scale=D**-0.5, window=6, sinks=ref_leaves[3],
              document_ids=docs).square().sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert (got.grad.double() - want.grad).abs().max().item() < 1e-5


def test_fold_sinks_is_exact_with_gradients():
    """out * sigmoid(lse - sink) from a sink-free attention equals the eager sink softmax, gradients too."""
    q, k, v, sinks, _ = _inputs(2)
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    sinks64 = sinks.double().requires_grad_()
    scores = (q @ k.transpose(-1, -2) * D**-0.5).masked_fill(~mask, float("-inf"))
    out = scores.softmax(-1) @ v
    folded = fold_sinks(out, scores.logsumexp(-1), sinks64)
    with_sink = torch.cat([scores, sinks64[None, :, None, None].expand(B, HQ, S, 1)], -1).softmax(-1)[..., :-1] @ v
    assert (folded - with_sink).abs().max().item() < 1e-12
    (g_fold,) = torch.autograd.grad(folded.sum(), sinks64)
    (g_eager,) = torch.autograd.grad(with_sink.sum(), sinks64)
    assert (g_fold - g_eager).abs().max().item() < 1e-12


def test_bad_window_and_backend_raise():
    with pytest.raises(ValueError, match="sliding_window"):
        build_inner_attention("flex", scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="backend"):
        AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, backend="bogus").build(32)


@pytest.mark.parametrize("backend", ["eager", "flex"])
def test_heads_split_like_the_plan_sum_to_the_whole(backend):
    """The plan's tensor-parallel split, run rank by rank in one process: q/k/v rows colwise, sinks
    sharded with the heads ("headwise", dim 0), o columns rowwise; the ranks' partial outputs sum to
    the unsplit attention (o's bias added once, as a rowwise Linear does)."""
    from titan_models.components.rope import RopeConfig

    tp, dim, heads, kv_heads, hd = 2, 32, 4, 2, 8
    full_config = AttentionConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, backend=backend, bias=True,
                                  sinks=True, sliding_window=5)
    torch.manual_seed(0)
    full = full_config.build(dim)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(2, S, dim)
    rope = tuple(t.float() for t in RopeConfig(dim=hd).build()(torch.arange(S).expand(2, S)))
    local_config = AttentionConfig(num_heads=heads // tp, num_kv_heads=kv_heads // tp, head_dim=hd, backend=backend,
                                   bias=True, sinks=True, sliding_window=5)
    total = torch.zeros(2, S, dim)
    with torch.no_grad():
        for rank in range(tp):
            local = local_config.build(dim)
            q_rows = slice(rank * heads // tp * hd, (rank + 1) * heads // tp * hd)
            kv_rows = slice(rank * kv_heads // tp * hd, (rank + 1) * kv_heads // tp * hd)
            for name, rows in (("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)):
                getattr(local, name).weight.copy_(getattr(full, name).weight[rows])
                getattr(local, name).bias.copy_(getattr(full, name).bias[rows])
            local.wo.weight.copy_(full.wo.weight[:, q_rows])
            local.wo.bias.copy_(full.wo.bias if rank == 0 else torch.zeros(dim))
            local.sinks.weight.copy_(full.sinks.weight.chunk(tp)[rank])
            total += local(x, rope)
        want = full(x, rope)
    assert ((total - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention (sinks through its lse) runs on CUDA")
@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
def test_compiled_flex_sinks_and_window_match_eager_on_gpu(packed):
    """The fused kernel: forward and the gradient through the returned log-sum-exp, fp32 on the GPU."""
    # head_dim 16: compiled flex_attention refuses embedding dimensions under 16
    q, k, v, sinks, docs = (t.cuda() for t in _inputs(3, head_dim=16))
    context = AttentionContext(document_ids=docs) if packed else None
    grads = {}
    for backend in ("flex", "eager"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        inner = build_inner_attention(backend, scale=16**-0.5, sliding_window=6)
        out = inner(*leaves[:3], context=context, sinks=leaves[3])
        out.square().sum().backward()
        grads[backend] = [out.detach()] + [t.grad for t in leaves]
    for got, want in zip(grads["flex"], grads["eager"]):
        assert ((got - want).norm() / want.norm()).item() < 1e-4
