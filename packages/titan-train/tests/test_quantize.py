"""titan_train.quantize's numerics against float64 references written from the formats' definitions
(titan_train_fp8_reference.py): quantisation bit-exact for every blocking (MX included), each recipe's three GEMMs
(forward, input and weight gradient) against float64 on the reference-quantised operands, and against the
unquantised float64 product within e4m3/e5m2's rounding bound. GPU kernels: same checks on CUDA (skipped on CPU).

Tolerances. The quantised GEMMs are compared with float64 products of the same fp8 values (exact: the scales
are powers of two), so the only error left is fp32 accumulation: |err| <= K 2^-24 (|A| |B|^T) (the classic
gamma_K bound), taken with a 2x margin. Against the unquantised product the bound is per-operand rounding:
e4m3 keeps 3 mantissa bits (relative error <= 2^-4 for normals), e5m2 2 bits (2^-3), plus the subnormal step
(half of 2^-9 resp. 2^-16 times the block scale) for tiny elements.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from titan_train_fp8_reference import FORMATS, quantize_reference, round_fp8

from titan_train.quantize import RECIPES, Blocking, quantize, quantized_linear
from titan_train.quantize.scaling import E4M3, E5M2

BLOCKINGS = {  # name: (Blocking, reference rows, cols, format, rule)
    "tensorwise": (Blocking(rows=0, cols=0), 0, 0, "e4m3", "amax"),
    "tensorwise_e5m2": (Blocking(rows=0, cols=0, dtype=E5M2), 0, 0, "e5m2", "amax"),
    "rowwise": (Blocking(rows=1, cols=0), 1, 0, "e4m3", "amax"),
    "tile_1x128": (Blocking(rows=1, cols=128, pad_cols=128), 1, 128, "e4m3", "amax"),
    "block_128x128": (Blocking(rows=128, cols=128, pad_cols=128), 128, 128, "e4m3", "amax"),
    "mx_1x32": (Blocking(rows=1, cols=32, rule="mx", pad_cols=32), 1, 32, "e4m3", "mx"),
}


def wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 values over ~20 binades, with an all-zero row and a few exact powers of two (binade edges)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-10, 10, (rows, cols), generator=g).float())
    x[3] = 0.0
    x[5, :4] = torch.tensor([2.0 ** 7, -(2.0 ** -3), 448.0, 2.0 ** -20])
    x[6] = x[6].clamp(-50, 50)
    x[6, 0] = -56.0  # amax 448 / 8: the scale 2^-3 fits exactly (the edge of the scale rule)
    return x


def test_fp8_reference_agrees_with_torch_casts():
    """The reference rounding equals torch's fp8 casts on in-range values (a check of the reference itself)."""
    v = wide_range(64, 64, seed=1).clamp(-400, 400).flatten()
    for fmt, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
        want = torch.tensor([round_fp8(x, fmt) for x in v.double().tolist()], dtype=torch.float64)
        assert torch.equal(v.to(dtype).double(), want), fmt


@pytest.mark.parametrize("name", list(BLOCKINGS))
def test_quantize_is_bit_exact_against_the_reference(name):
    blocking, rows, cols, fmt, rule = BLOCKINGS[name]
    x = wide_range(136, 256, seed=2)  # 136 rows: a partial 128-row block
    if name == "mx_1x32":
        x[7, :32] = torch.tensor([480.0] + [1.0] * 31)  # amax 480 -> scale 2^0, 480 saturates to 448 (spec)
    got = quantize(x, blocking)
    deq, values, scales = quantize_reference(x, rows, cols, fmt, rule)
    assert got.data.dtype == blocking.dtype
    assert torch.equal(got.data.double(), values)
    assert torch.equal(got.scale_per_element().double(), scales)
    assert torch.equal(got.dequantize(torch.float64), deq)
    if name == "mx_1x32":
        assert got.data[7, 0].item() == 448.0 and got.scale_per_element()[7, 0].item() == 1.0


@pytest.mark.parametrize("name", [n for n in BLOCKINGS if n != "mx_1x32"])
def test_dequantized_values_are_within_the_format_epsilon(name):
    blocking, *_ , fmt, _ = BLOCKINGS[name]
    mbits, emin, _ = FORMATS[fmt]
    x = wide_range(136, 256, seed=3).double()
    got = quantize(x.float(), blocking)
    scale = got.scale_per_element().double()[:, :x.shape[1]]
    bound = 2.0 ** -(mbits + 1) * x.abs() + 2.0 ** (emin - mbits - 1) * scale
    assert ((got.dequantize(torch.float64) - x).abs() <= bound).all()


def test_padding_and_unpadded_reduction():
    """A reduction length that is no multiple of the block is zero-padded: same values, zeros beyond."""
    x = torch.randn(5, 200)
    got = quantize(x, Blocking(rows=1, cols=128, pad_cols=128))
    assert got.data.shape == (5, 256) and got.scale.shape == (5, 2)
    assert (got.data[:, 200:].float() == 0).all()
    deq, _, _ = quantize_reference(torch.nn.functional.pad(x, (0, 56)), 1, 128)
    assert torch.equal(got.dequantize(torch.float64), deq[:, :200])


def test_quantized_data_is_row_major_for_transposed_inputs():
    """The backward quantises transposes (dy^T, x^T, W^T): the fp8 data must still be row-major."""
    for blocking in (Blocking(rows=0, cols=0, pad_cols=16), Blocking(rows=1, cols=0, pad_cols=16)):
        got = quantize(torch.randn(64, 48).t(), blocking)
        assert got.data.is_contiguous() and got.data.shape == (48, 64)


def _reference_gemm(a: torch.Tensor, b: torch.Tensor, blocking_a: Blocking, blocking_b: Blocking):
    """(float64 a_q . b_q^T on reference-quantised operands, |a| |b|^T, the exact unquantised product)."""
    def ref(t, blk):
        fmt = "e5m2" if blk.dtype == E5M2 else "e4m3"
        cols = blk.cols
        padded = torch.nn.functional.pad(t, (0, (-t.shape[1]) % (cols or 1)))
        return quantize_reference(padded, blk.rows, cols, fmt, blk.rule)[0][:, :t.shape[1]]
    magnitude = a.double().abs() @ b.double().abs().t()
    return ref(a, blocking_a) @ ref(b, blocking_b).t(), magnitude, a.double() @ b.double().t()


def _check_gemm(got, a, b, blocking_a, blocking_b, what):
    want_q, magnitude, exact = _reference_gemm(a, b, blocking_a, blocking_b)
    k = a.shape[1]
    assert ((got.double() - want_q).abs() <= 2 * k * 2.0 ** -24 * magnitude + 1e-30).all(), what
    # against the unquantised product: each operand's relative rounding, e4m3 2^-4, e5m2 2^-3
    eps = sum(2.0 ** -(FORMATS["e5m2" if blk.dtype == E5M2 else "e4m3"][0] + 1) for blk in (blocking_a, blocking_b))
    assert ((got.double() - exact).abs() <= (eps + 2 ** -7) * magnitude + 1e-3 * magnitude.mean()).all(), what


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gemms_forward_and_backward_against_float64(recipe):
    """y = x W^T, dx = dy W, dW = dy^T x through the recipe (CPU: the emulated path), each against float64."""
    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 100, 256, generator=g).requires_grad_()  # 200 tokens: the weight gradient pads them
    w = (torch.randn(384, 256, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(2, 100, 384, generator=g) * 1e-3
    y = quantized_linear(x, w, r, out_dtype=torch.float32)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 256), dy.reshape(-1, 384)
    _check_gemm(y.reshape(-1, 384), x2, w.detach(), r.x, r.weight, "forward")
    _check_gemm(x.grad.reshape(-1, 256), dy2, w.detach().t(), r.grad_output, r.weight_t, "input grad")
    _check_gemm(w.grad, dy2.t(), x2.t(), r.grad_output_t, r.x_t, "weight grad")
    assert w.grad.dtype == w.dtype and x.grad.dtype == x.dtype


def test_a_wrong_scale_layout_fails_the_gemm_check():
    """Control: the same check rejects a result whose weight blocks took their neighbours' scales."""
    r = RECIPES["fp8_blockwise"]
    x, w = torch.randn(64, 256), torch.randn(256, 256) * torch.tensor([1.0, 100.0]).repeat_interleave(128)[:, None]
    qx, qw = quantize(x, r.x), quantize(w, r.weight)
    qw.scale = qw.scale.flip(0)
    wrong = qx.dequantize() @ qw.dequantize().t()
    with pytest.raises(AssertionError):
        _check_gemm(wrong, x, w, r.x, r.weight, "control")


def test_bf16_inputs_give_bf16_outputs_and_gradients():
    r = RECIPES["fp8_rowwise"]
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    y = quantized_linear(x, w, r, out_dtype=torch.bfloat16)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16


def _cpu_scaled_mm_available(rows: int) -> bool:
    """Whether this torch's CPU torch._scaled_mm takes scales of `rows` rows (torch 2.11's takes only one per
    tensor; 2.14's takes one per row too)."""
    a = torch.zeros(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(rows, 1), scale_b=torch.ones(1, rows), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("recipe", [
    pytest.param("fp8_tensorwise", marks=pytest.mark.skipif(not _cpu_scaled_mm_available(1),
                                                            reason="this torch has no CPU torch._scaled_mm")),
    pytest.param("fp8_rowwise", marks=pytest.mark.skipif(not _cpu_scaled_mm_available(16),
                                                         reason="this torch's CPU torch._scaled_mm takes per-tensor "
                                                                "scales only (torch 2.11)"))])
def test_scaled_mm_layouts_on_cpu(recipe):
    """The torch._scaled_mm call (operand majorness, scale shapes, e5m2 x e4m3) through torch's CPU kernel, against
    float64 of the same fp8 values: fp32 accumulation, plus bf16 output rounding (<= 2^-8 relative) for rowwise."""
    from titan_train.quantize.gemm import _scaled_mm

    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(6)
    x, w, dy = torch.randn(40, 200, generator=g), torch.randn(48, 200, generator=g), torch.randn(40, 48, generator=g)
    operands = ((x, w, r.x, r.weight), (dy, w.t(), r.grad_output, r.weight_t), (dy.t(), x.t(), r.grad_output_t, r.x_t))
    for a, b, ba, bb in operands:
        got = _scaled_mm(quantize(a, ba), quantize(b, bb), out_dtype=torch.float32)
        want, magnitude, _ = _reference_gemm(a, b, ba, bb)
        rounding = 2.0 ** -8 * want.abs() if recipe == "fp8_rowwise" else 0
        assert ((got.double() - want).abs() <= rounding + 2 * a.shape[1] * 2.0 ** -24 * magnitude).all(), recipe


def test_blockwise_triton_kernel_in_the_interpreter():
    """The Triton blockwise GEMM under TRITON_INTERPRET=1 (fp32 tensors holding e4m3 values) against float64."""
    script = Path(__file__).with_name("fp8_kernel_checks.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results and all(r["ok"] for r in results.values()), results


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._scaled_mm, Triton fp8)")


@cuda
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_gemms_match_float64(recipe):
    """The CUDA kernels (torch._scaled_mm, the Triton blockwise GEMM, MX via bf16 or tl.dot_scaled) against the
    float64 reference, in bf16 output (one more rounding: 2^-9 relative)."""
    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 512, generator=g)
    w = torch.randn(384, 512, generator=g) * 0.05
    dy = torch.randn(300, 384, generator=g) * 1e-3
    xc, wc = x.cuda().bfloat16().requires_grad_(), w.cuda().bfloat16().requires_grad_()
    y = quantized_linear(xc, wc, r, out_dtype=torch.bfloat16)
    y.backward(dy.cuda().bfloat16())
    xb, wb, dyb = xc.detach().float().cpu(), wc.detach().float().cpu(), dy.bfloat16().float()
    for got, a, b, ba, bb in ((y, xb, wb, r.x, r.weight), (xc.grad, dyb, wb.t(), r.grad_output, r.weight_t),
                              (wc.grad, dyb.t(), xb.t(), r.grad_output_t, r.x_t)):
        want, magnitude, _ = _reference_gemm(a, b, ba, bb)
        err = (got.float().cpu().double() - want).abs()
        assert (err <= 2.0 ** -8 * want.abs() + 2 * a.shape[1] * 2.0 ** -22 * magnitude).all(), recipe


@pytest.mark.parametrize(("name", "blocking", "blocking_t", "reused"), [
    ("tensorwise", Blocking(rows=0, cols=0, pad_cols=16), Blocking(rows=0, cols=0, pad_cols=16), True),
    ("tensorwise_e5m2", Blocking(rows=0, cols=0, dtype=E5M2, pad_cols=16),
     Blocking(rows=0, cols=0, dtype=E5M2, pad_cols=16), True),
    ("block_128x128", Blocking(rows=128, cols=128, pad_cols=128), Blocking(rows=128, cols=128, pad_cols=128), True),
    ("rowwise", Blocking(rows=1, cols=0, pad_cols=16), Blocking(rows=1, cols=0, pad_cols=16), False),
    ("tile_1x128", Blocking(rows=1, cols=128, pad_cols=128), Blocking(rows=1, cols=128, pad_cols=128), False),
    ("tensorwise_e4m3_to_e5m2", Blocking(rows=0, cols=0, pad_cols=16), Blocking(rows=0, cols=0, dtype=E5M2), False)])
def test_a_transpose_reuses_the_exponents_only_where_they_are_its_own(name, blocking, blocking_t, reused):
    """The backward quantises x^T, W^T (and dy^T) with the exponents of x, W (dy) where its blocks are theirs
    transposed: the same bits (data and scales) as quantising the transpose from scratch, checked against the
    float64 reference; elsewhere no exponents are offered."""
    from titan_train.quantize.scaling import transposed_exponent

    x = wide_range(256, 384, seed=7)
    x[:, 200] *= 1e4  # one column far larger: a column's scale differs from a row's
    q = quantize(x, blocking)
    exponent = transposed_exponent(q, blocking_t)
    assert (exponent is not None) == reused, name
    if not reused:
        return
    got, fresh = quantize(x.t(), blocking_t, exponent=exponent), quantize(x.t(), blocking_t)
    assert torch.equal(got.data.view(torch.uint8), fresh.data.view(torch.uint8))
    assert torch.equal(got.scale, fresh.scale) and torch.equal(got.exponent, fresh.exponent)
    fmt = "e5m2" if blocking_t.dtype == E5M2 else "e4m3"
    deq, _, _ = quantize_reference(x.t(), blocking_t.rows, blocking_t.cols, fmt, blocking_t.rule)
    assert torch.equal(got.dequantize(torch.float64), deq)


def test_a_given_exponent_of_the_wrong_grid_is_refused():
    q = quantize(torch.randn(256, 128), Blocking(rows=128, cols=128, pad_cols=128))
    with pytest.raises(ValueError, match="grid"):
        quantize(torch.randn(256, 128), Blocking(rows=128, cols=128, pad_cols=128), exponent=q.exponent.t())


def test_the_backward_reuses_forward_exponents_and_still_matches_float64():
    """Control of the reuse in the autograd Function: a wrong saved exponent (two binades too large: the largest
    elements saturate) must change the weight gradient, so the reused exponent is the one the backward uses."""
    import titan_train.quantize.quantized_matmul as qm

    r = RECIPES["fp8_tensorwise"]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 128, generator=g).requires_grad_()
    w = (torch.randn(96, 128, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(64, 96, generator=g) * 1e-3
    quantized_linear(x, w, r, out_dtype=torch.float32).backward(dy)
    _check_gemm(w.grad, dy.t(), x.detach().t(), r.grad_output_t, r.x_t, "weight grad")
    good = w.grad.clone()
    original = qm._reused_exponent

    def off_by_one(*args):
        exponent = original(*args)
        return None if exponent is None else exponent + 2  # saturates the largest elements

    w.grad = None
    qm._reused_exponent = off_by_one
    try:
        quantized_linear(x, w, r, out_dtype=torch.float32).backward(dy)
    finally:
        qm._reused_exponent = original
    assert not torch.equal(w.grad, good)


@cuda
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise"])
def test_gpu_fast_accum_forward_against_float64(recipe):
    """quantize.fast_accum: the forward GEMM on the tensor cores' own accumulator (no fp32 promotion) against
    the float64 product of the same fp8 values. Its accumulator keeps fewer bits than fp32 (DeepSeek-V3 section
    3.3.2 measured ~14), so the bound is per reduction length K = 4096: K 2^-14 relative to |x| |W|^T at worst,
    taken as 2^-6 (a wrong operand or scale is off by ~ |x| |W|^T / sqrt(K) = 2^-6 of it, on most elements, so
    the check also asks the median error to be 16x smaller)."""
    import dataclasses

    r = dataclasses.replace(RECIPES[recipe], forward_fast_accum=True)
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(256, 4096, generator=g), torch.randn(384, 4096, generator=g) * 0.05
    y = quantized_linear(x.cuda().bfloat16(), w.cuda().bfloat16(), r, out_dtype=torch.bfloat16)
    want, magnitude, _ = _reference_gemm(x.bfloat16().float(), w.bfloat16().float(), r.x, r.weight)
    err = (y.float().cpu().double() - want).abs()
    assert (err <= 2.0 ** -8 * want.abs() + 2.0 ** -6 * magnitude).all(), recipe
    assert (err / magnitude).median() <= 2.0 ** -10, recipe
