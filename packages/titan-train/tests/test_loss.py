"""The fused chunked cross-entropy against a float64 reference, and the learning-rate schedules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_models as tm
import titan_train.loss as loss_module
from titan_train import LRScheduleConfig
from titan_train.data import IGNORE_INDEX
from titan_train.loss import CausalLMLoss, fused_linear_cross_entropy
from titan_train.lr_schedule import lr_factor


@pytest.mark.parametrize("chunk", [1, 5, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_cross_entropy_matches_float64_reference(chunk, dtype):
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(3, 21, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(37, 16, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, 37, (3, 21), generator=g)
    labels[0, :4] = IGNORE_INDEX
    h, w = hidden.to(dtype, copy=True).requires_grad_(), weight.to(dtype, copy=True).requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, chunk=chunk)
    (loss * 0.7).backward()
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.T).reshape(-1, 37), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    (ref * 0.7).backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert loss.item() == pytest.approx(ref.item(), rel=tol)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=tol * 10, atol=tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol * 10, atol=tol)
    assert h.grad[0, :4].abs().max() == 0  # ignored tokens contribute nothing


def test_fusable_chunk_formulation_equals_the_in_place_one():
    from titan_train.loss import _chunk_loss_and_grad, _chunk_loss_and_grad_fusable

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 50, generator=g)
    target, valid = torch.randint(0, 50, (9,), generator=g), torch.rand(9, generator=g) > 0.3
    loss, grad = _chunk_loss_and_grad(logits.clone(), target, valid, acc=torch.float32)  # overwrites its input
    loss2, grad2 = _chunk_loss_and_grad_fusable(logits, target, valid, acc=torch.float32)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2, grad)


def test_compiled_chunks_and_autocast_match_float64():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(40, 16, generator=g), torch.randn(70, 16, generator=g) * 0.3
    labels = torch.randint(0, 70, (40,), generator=g)
    labels[:3] = IGNORE_INDEX
    ref = F.cross_entropy(hidden.double() @ weight.double().T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, chunk=16, compiled=True)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    # Under bf16 autocast the products run in bf16 (fp32 master weight), the softmax and sums in fp32,
    # and the gradients come back in the inputs' dtypes.
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, labels, chunk=16)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)


def test_fused_cross_entropy_bf16_inputs_close_to_float64():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(64, 32, generator=g), torch.randn(300, 32, generator=g) * 0.2
    labels = torch.randint(0, 300, (64,), generator=g)
    loss = fused_linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), labels, chunk=16)
    ref = F.cross_entropy(hidden.double() @ weight.double().T, labels, reduction="sum")
    assert loss.dtype == torch.float32  # softmax and sums in fp32 whatever the compute dtype
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)


def _cpu_peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once while fn ran, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_fused_loss_holds_one_chunk_of_logits_at_a_time():
    """fp32 on CPU (the eager chunk, in place on the logits): the forward's peak is the [V, d] weight gradient,
    the [N, d] hidden gradient and two [C, V] buffers (a chunk's logits and logsumexp's temporary), not the
    previous chunk's logits on top (issue 23: the loop's names kept them alive into the next chunk)."""
    g = torch.Generator().manual_seed(5)
    tokens, dim, vocab, chunk = 256, 32, 4000, 64
    h = torch.randn(tokens, dim, generator=g).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    peak = _cpu_peak_bytes(lambda: fused_linear_cross_entropy(h, w, labels, chunk=chunk))
    grad_w, grad_h, logits = vocab * dim * 4, tokens * dim * 4, chunk * vocab * 4
    assert peak < grad_w + grad_h + 2.5 * logits, (peak, grad_w, grad_h, logits)  # a third chunk would be 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 products with fp32 output)")
def test_fused_loss_accumulates_the_weight_gradient_in_place_on_gpu():
    """bf16 on CUDA over 4 chunks (the in-place fp32 addmm of each chunk's weight gradient): loss and both
    gradients within bf16 rounding of float64, and the loss peak holds one fp32 weight gradient, not two."""
    g = torch.Generator().manual_seed(3)
    tokens, dim, vocab, chunk = 2048, 256, 32000, 512
    hidden, weight = torch.randn(tokens, dim, generator=g), torch.randn(vocab, dim, generator=g) * 0.05
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[:100] = IGNORE_INDEX
    h = hidden.cuda().bfloat16().requires_grad_()
    w = weight.cuda().bfloat16().requires_grad_()
    y = labels.cuda()
    # Warm-up, unmeasured: a process's first GEMMs allocate cuBLAS's workspace (32 MiB on Hopper) through the
    # caching allocator, which would count in the peak (issue 23's 135 MB held it and a stale chunk of logits).
    fused_linear_cross_entropy(h, w, y, chunk=chunk, triton=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(h, w, y, chunk=chunk, triton=True)
    peak = torch.cuda.max_memory_allocated() - base
    loss.backward()
    h64, w64 = h.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        err = (got.double().cpu() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err
    assert loss_module._out_dtype_products, "torch.addmm(out_dtype=fp32, out=acc) fell back to a bf16 product"
    fp32_grad, logits = vocab * dim * 4, chunk * vocab * 2
    assert peak < fp32_grad + logits + fp32_grad // 2, (peak, fp32_grad, logits)  # not two fp32 gradients


def test_weight_gradient_summed_in_the_weights_dtype_stays_within_bf16_rounding_of_float64():
    """training.loss_weight_grad_dtype=param: bf16 weights sum their gradient over the chunks in bf16; both
    gradients stay within bf16 rounding of float64, the fp32 sum is the closer one (the option does
    something), and fp32 weights give the fp32 sum bit for bit."""
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(256, 32, generator=g), torch.randn(300, 32, generator=g) * 0.2
    labels = torch.randint(0, 300, (256,), generator=g)
    labels[:7] = IGNORE_INDEX
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    F.cross_entropy(h64 @ w64.T, labels, ignore_index=IGNORE_INDEX, reduction="sum").backward()
    errors = {}
    for in_param_dtype in (False, True):
        h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
        fused_linear_cross_entropy(h, w, labels, chunk=16, weight_grad_in_param_dtype=in_param_dtype).backward()
        assert w.grad.dtype == torch.bfloat16
        errors[in_param_dtype] = ((w.grad.double() - w64.grad).abs().max() / w64.grad.abs().max()).item()
    assert errors[True] < 2e-2 and errors[False] < errors[True], errors
    grads = []
    for in_param_dtype in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fused_linear_cross_entropy(h, w, labels, chunk=16, weight_grad_in_param_dtype=in_param_dtype).backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


def test_schedules():
    steps = 100
    wsd = LRScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    factors = [lr_factor(s, steps, wsd) for s in range(steps)]
    assert factors[0] > 0 and all(a < b for a, b in zip(factors[:10], factors[1:11]))  # warmup rises
    assert factors[10:80] == [1.0] * 70  # stable
    assert all(a > b for a, b in zip(factors[80:], factors[81:]))  # decays
    assert factors[-1] == pytest.approx(0.1)
    cosine = LRScheduleConfig(kind="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(0, steps, cosine) == pytest.approx(1.0)
    assert lr_factor(50, steps, cosine) == pytest.approx(0.5)
    assert lr_factor(100, steps, cosine) == pytest.approx(0.0, abs=1e-12)
    sqrt = LRScheduleConfig(kind="wsd", warmup_steps=0, decay_fraction=0.5, decay_shape="sqrt")
    assert lr_factor(74, steps, sqrt) == pytest.approx(1 - (25 / 50) ** 0.5)


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_loss_matches_one_process(world, tmp_path):
    """The vocabulary sharded over gloo ranks (max and sums all-reduced) gives one process's loss and
    gradients, in float64 (F.cross_entropy on the whole logits as reference)."""
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the worker by this path
    from titan_train_ranks import file_rendezvous
    from vocab_parallel_ranks import rank_main, vocab_parallel_inputs

    h, w, y = vocab_parallel_inputs()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.cross_entropy((h_ref @ w_ref.t()).reshape(-1, 40), y.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    want.backward()
    init_method = file_rendezvous(tmp_path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, init_method, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    rows = 40 // world
    for rank, (loss, grad_h, grad_w) in results.items():
        loss, grad_h, grad_w = (torch.tensor(x, dtype=torch.float64) for x in (loss, grad_h, grad_w))
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_h, h_ref.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_w, w_ref.grad[rank * rows:(rank + 1) * rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_fused_loss_applies_a_scaled_soft_capped_head_like_autograd(softcap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[3] = IGNORE_INDEX
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk=8, logit_scale=1.5, logit_softcap=softcap)
    loss.backward()
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T * 1.5
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
        assert (logits.abs() > softcap / 2).float().mean() > 0.3  # the curved range, not tanh's linear part
    expected = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    expected.backward()
    for ours, theirs in zip(got, (expected.detach(), hidden.grad, weight.grad)):
        assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)


def test_causal_lm_loss_uses_the_models_soft_capped_head():
    model = tm.flavor("muse_glimmer", "debug")
    with torch.device("meta"):
        model = model.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(300.0)  # logits into the cap's curved range
    tokens = torch.randint(0, model.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, dims=1)
    with torch.no_grad():
        logits = model(tokens)
        assert (logits.abs() > model.logit_softcap / 2).float().mean() > 0.3
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        assert torch.allclose(CausalLMLoss(model)(tokens, labels), expected, rtol=1e-5)
