"""Batch-invariant ops: correct against float64, and a row's bits independent of the rest of the batch."""
from __future__ import annotations

import math
import random

import pytest
import torch

from titan_rl.batch_invariant import torch_ops as ops


pytestmark = pytest.mark.usefixtures("all_threads")  # multi-threaded kernels must be invariant too


DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _compositions(rows: torch.Tensor, seed: int, trials: int = 12):
    """Yields (index, batch) pairs: random subsets of `rows`, shuffled, with random extra rows."""
    rng = random.Random(seed)
    for _ in range(trials):
        idx = rng.sample(range(len(rows)), rng.randint(1, len(rows)))
        extra = torch.randn(rng.randint(0, 40), *rows.shape[1:]).to(rows.dtype)
        yield idx, torch.cat([rows[idx], extra])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, N", [(256, 768), (768, 256), (64, 2048)])
def test_matmul(dtype, K, N):
    torch.manual_seed(0)
    w = torch.randn(N, K).to(dtype)
    x = torch.randn(24, K).to(dtype)
    ref = x.double() @ w.double().T
    out = ops.matmul(x, w)
    assert (out.double() - ref).abs().max() / ref.abs().max() < TOL[dtype]
    singles = [ops.matmul(x[i:i + 1], w)[0] for i in range(len(x))]
    for idx, batch in _compositions(x, seed=K + N):
        got = ops.matmul(batch, w)
        for r, i in enumerate(idx):
            assert torch.equal(got[r], singles[i]), (idx, r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_log_softmax(dtype):
    torch.manual_seed(1)
    x = (torch.randn(20, 300) * 3).to(dtype)
    w = (torch.rand(300) + 0.5).to(dtype)
    xd = x.double()
    ref_norm = (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double() * w.double()
    assert (ops.rms_norm(x, w, 1e-5).double() - ref_norm).abs().max() < TOL[dtype] * 10
    ref_lsm = xd - torch.logsumexp(xd, -1, keepdim=True)
    assert (ops.log_softmax(x).double() - ref_lsm).abs().max() < 1e-5
    assert (ops.softmax(x).double() - ref_lsm.exp()).abs().max() < 1e-6
    assert ops.tree_sum(torch.arange(7.0)).item() == 21.0
    single_norm = [ops.rms_norm(x[i:i + 1], w, 1e-5)[0] for i in range(len(x))]
    single_lsm = [ops.log_softmax(x[i:i + 1])[0] for i in range(len(x))]
    for idx, batch in _compositions(x, seed=2):
        norm, lsm = ops.rms_norm(batch, w, 1e-5), ops.log_softmax(batch)
        for r, i in enumerate(idx):
            assert torch.equal(norm[r], single_norm[i]) and torch.equal(lsm[r], single_lsm[i])


def _attention_reference(q, k, v, positions, scale, window=None, sinks=None):
    """float64; with a window, slots more than window - 1 before the position are hidden; with sinks [hq],
    exp(sink) joins each softmax denominator."""
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    scores = torch.einsum("bshd,blhd->bhsl", qd, kd) * scale
    slots, pos = torch.arange(k.shape[1])[None, None, None, :], positions[:, None, :, None]
    masked = (slots > pos) | ((pos - slots >= window) if window is not None else False)
    weights = scores.masked_fill(masked, -math.inf).exp()
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.double().exp()[None, :, None, None]
    return torch.einsum("bhsl,blhd->bshd", weights / denominator, vd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, with_sinks", [(None, False), (40, True)], ids=["causal", "window40-sinks"])
def test_attention_prefill_and_decode_are_invariant(dtype, window, with_sinks):
    torch.manual_seed(3)
    hq, hkv, d = 4, 2, 64
    scale = d ** -0.5
    sinks = torch.randn(hq) * 2 if with_sinks else None
    extra = {"window": window, "sinks": sinks}
    lengths = [1, 5, 63, 64, 65, 130]
    seqs = [torch.randn(n, hq + 2 * hkv, d).to(dtype) for n in lengths]
    split = lambda t: (t[..., :hq, :], t[..., hq:hq + hkv, :], t[..., hq + hkv:, :])
    singles = []
    for x in seqs:
        q, k, v = split(x[None])
        pos = torch.arange(len(x))[None]
        out = ops.attention(q, k, v, q_positions=pos, scale=scale, **extra)
        assert (out.double() - _attention_reference(q, k, v, pos, scale, **extra)).abs().max() < TOL[dtype] * 10
        singles.append(out[0])
    rng = random.Random(4)
    for _ in range(8):
        idx = rng.sample(range(len(seqs)), rng.randint(1, len(seqs)))
        S = max(lengths[i] for i in idx) + rng.randint(0, 70)
        X = torch.randn(len(idx), S, hq + 2 * hkv, d).to(dtype)  # random padding
        for r, i in enumerate(idx):
            X[r, :lengths[i]] = seqs[i]
        q, k, v = split(X)
        full = ops.attention(q, k, v, q_positions=torch.arange(S).expand(len(idx), S), scale=scale, **extra)
        # Decode: one query per sequence at its last position, over a larger zero-initialised cache.
        cap = S + rng.randint(0, 100)
        ck, cv = torch.zeros(len(idx), cap, hkv, d, dtype=dtype), torch.zeros(len(idx), cap, hkv, d, dtype=dtype)
        ck[:, :S], cv[:, :S] = k, v
        last = torch.tensor([lengths[i] - 1 for i in idx])
        one = ops.attention(q[torch.arange(len(idx)), last][:, None], ck, cv, q_positions=last[:, None],
                            scale=scale, kv_len=last + 1, **extra)
        for r, i in enumerate(idx):
            assert torch.equal(full[r, :lengths[i]], singles[i])
            assert torch.equal(one[r, 0], singles[i][-1])


def test_attention_gradient_matches_reference():
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 70, h, 32, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    pos = torch.arange(70).expand(2, 70)
    ops.attention(q, k, v, q_positions=pos, scale=0.2).pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _attention_reference(q, k, v, pos, 0.2).pow(2).sum().backward()
    for got, t in zip(grads, (q, k, v)):
        assert torch.allclose(got, t.grad, atol=1e-10)


def test_attention_gradient_with_window_and_sinks_matches_reference():
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 70, h, 32, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    sinks = (torch.randn(4, dtype=torch.float64) * 2).requires_grad_()
    pos = torch.arange(70).expand(2, 70)
    ops.attention(q, k, v, q_positions=pos, scale=0.2, window=20, sinks=sinks).pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    _attention_reference(q, k, v, pos, 0.2, window=20, sinks=sinks).pow(2).sum().backward()
    for got, t in zip(grads, (q, k, v, sinks)):
        assert torch.allclose(got, t.grad, atol=1e-10)
