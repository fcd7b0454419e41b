"""grouped_mm_fp8 against float64 references (tests/dist_moe_fp8_reference.py, written from the formats).

- The quantiser bit for bit against a float64 round-to-nearest-even onto the e4m3 / e5m2 grids.
- Forward, input and weight gradients with float32 inputs (so the fp8 values are exactly the
  reference's) against float64 quantise-dequantise-matmul per expert: 1e-5 relative to the
  largest entry (float32 accumulation and dequantisation over <= 384 terms).
- With bfloat16 inputs against the unquantised float64 product, elementwise within the rounding
  bound of fp8 (dist_moe_fp8_reference.rounding_bound) plus the bf16 output rounding (2^-8 relative): a
  bound derived from the formats, not measured.
The Triton kernels run the same checks interpreted on CPU (test_triton_interpret_fp8.py) and on CUDA.
"""
from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

import pytest
import torch

import dist_moe
from dist_moe.fp8_quant import Fp8Recipe, quantize_blocks, scale_of

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test directory
from dist_moe_fp8_reference import FORMATS, block_scales, exact, quotient, reference, round_to_format, rounding_bound  # noqa: E402

COUNTS = [5, 0, 130, 1, 0, 20]  # ragged, two empty, one past a 128-row chunk


def operands(counts, k, n, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    # Rows of very different magnitudes: per-row scales matter (one tensor scale would flush the small ones).
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 2, rows).reshape(-1, 1)[torch.randperm(rows, generator=gen)]
    stored = torch.randn(len(counts), n, k, generator=gen)  # Linear-style [E, N, K]
    grad = torch.randn(rows, n, generator=gen)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), stored.to(**to), grad.to(**to), offsets.to(device)


def run(x, stored, grad, offsets, recipe, backend):
    x = x.clone().requires_grad_()
    stored = stored.clone().requires_grad_()
    out = dist_moe.grouped_mm_fp8(x, stored.transpose(1, 2), offsets, recipe=recipe, backend=backend)
    out.backward(grad)
    return out, x.grad, stored.grad


def close(got, want, rtol):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale, f"error {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("blocks", [(1, 256), (1, 128), (128, 128), (256, 1)])
def test_quantize_matches_float64_rounding(fmt, dtype, blocks):
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(256, 256, generator=gen) * torch.logspace(-4, 3, 256).reshape(-1, 1)
    t[3] = 0  # a zero row: a finite scale, zeros out
    q, scale = quantize_blocks(t, *blocks, dtype)
    want_scale = block_scales(t, *blocks, fmt)
    assert torch.equal(scale.double(), want_scale)
    wide = want_scale.repeat_interleave(blocks[0], 0).repeat_interleave(blocks[1], 1)
    want = round_to_format(quotient(t, wide), fmt)
    assert torch.equal(q.double(), want)
    assert q.double().abs().max() <= torch.finfo(dtype).max and q[3].double().abs().max() == 0


def _float32_nearest(v: Fraction) -> float:
    """The float32 nearest an exact rational (ties to even), found among the neighbours of a first guess."""
    guess = np.float32(float(v))
    near = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return float(min(near, key=lambda f: (abs(Fraction(float(f)) - v), int(np.float32(f).view(np.int32)) & 1)))


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_scales_are_the_correctly_rounded_quotient(fmt, dtype):
    # amax / max as exact rationals rounded to float32, against the scale; the float64 quotient is right
    # whether the device divides or, as torch's CUDA kernel by a Python scalar, multiplies by the reciprocal
    gen = torch.Generator().manual_seed(3)
    amax = (torch.rand(4000, generator=gen) * torch.logspace(-6, 6, 4000)).float()
    top = FORMATS[fmt][3]
    want = torch.tensor([_float32_nearest(Fraction(a) / Fraction(top)) for a in amax.double().tolist()],
                        dtype=torch.float64)
    assert torch.equal(scale_of(amax, dtype).double(), want)
    assert torch.equal((amax.double() * (1.0 / top)).float().double(), want)
    # control: float32 multiplication by the reciprocal (what the CUDA division did) is an ulp off for many
    off = (amax * torch.tensor(1.0 / top, dtype=torch.float32)).double() != want
    assert off.sum() > 100


def test_rounding_reference_ties_to_even():
    # Midpoints of e4m3 neighbours: 1.0625 between 1.0 (code 0x38) and 1.125 (0x39) goes to 1.0;
    # 1.1875 between 1.125 and 1.25 (0x3A) goes to 1.25. Against torch's own cast as a second opinion.
    v = torch.tensor([1.0625, 1.1875, -1.0625, 448.0, 0.001953125 * 1.5], dtype=torch.float64)
    want = torch.tensor([1.0, 1.25, -1.0, 448.0, 0.00390625], dtype=torch.float64)
    assert torch.equal(round_to_format(v, "e4m3"), want)
    assert torch.equal(v.float().to(torch.float8_e4m3fn).double(), want)


@pytest.mark.parametrize("granularity", ["rowwise", "blockwise"])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_torch_path_matches_float64_quantised_matmul(granularity, grad_format):
    x, stored, grad, offsets = operands(COUNTS, k=256, n=384, dtype=torch.float32)
    recipe = Fp8Recipe(granularity=granularity, grad_format=grad_format)
    out, dx, dw = run(x, stored, grad, offsets, recipe, "torch")
    want_out, want_dx, want_dw = reference(x, stored.transpose(1, 2), grad, COUNTS, granularity, grad_format)
    close(out, want_out, 1e-5)
    close(dx, want_dx, 1e-5)
    close(dw.transpose(1, 2), want_dw, 1e-5)


def test_recipes_are_told_apart():
    """Control: the rowwise result is not within the tolerance of the blockwise reference."""
    x, stored, grad, offsets = operands(COUNTS, k=256, n=384, dtype=torch.float32)
    out, _, dw = run(x, stored, grad, offsets, "rowwise", "torch")
    want_out, _, want_dw = reference(x, stored.transpose(1, 2), grad, COUNTS, "blockwise")
    for got, want in ((out, want_out), (dw.transpose(1, 2), want_dw)):
        with pytest.raises(AssertionError):
            close(got, want, 1e-5)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_bf16_inputs_within_the_fp8_rounding_bound(recipe):
    x, stored, grad, offsets = operands(COUNTS, k=256, n=384, dtype=torch.bfloat16)
    out, dx, dw = run(x, stored, grad, offsets, recipe, "torch")
    assert out.dtype == dx.dtype == dw.dtype == torch.bfloat16 and dw.shape == stored.shape
    w = stored.transpose(1, 2)
    want_out, want_dx, want_dw = exact(x, w, grad, COUNTS)
    start, bf16 = 0, 2.0 ** -8
    for e, c in enumerate(COUNTS):
        if c == 0:
            continue
        xe, ge, we = x[start:start + c].double(), grad[start:start + c].double(), w[e].double()
        rows = slice(start, start + c)
        for got, want, bound in ((out[rows], want_out[rows], rounding_bound(xe, we, 3, 3)),
                                 (dx[rows], want_dx[rows], rounding_bound(ge, we.T, 3, 3)),
                                 (dw[e].T, want_dw[e], rounding_bound(xe.T, ge, 3, 3))):
            excess = (got.double() - want).abs() - bound - bf16 * want.abs() - 1e-6 * bound.max()
            assert excess.max() <= 0, f"expert {e}: past the fp8 bound by {excess.max():.3e}"
        start += c
    assert torch.count_nonzero(dw[[1, 4]]) == 0
    # Typical error: a few percent of the product (e4m3 keeps 3 mantissa bits), more than bf16's.
    rel = (out.double() - want_out).norm() / want_out.norm()
    bf16_rel = (dist_moe.grouped_mm(x, w, offsets).double() - want_out).norm() / want_out.norm()
    assert bf16_rel < rel < 0.06


def test_every_group_empty_and_one_row():
    for counts in ([0, 0, 0], [0, 1, 0]):
        x, stored, grad, offsets = operands(counts, k=128, n=128, dtype=torch.float32)
        out, dx, dw = run(x, stored, grad, offsets, "blockwise", "torch")
        want_out, want_dx, want_dw = reference(x, stored.transpose(1, 2), grad, counts, "blockwise")
        assert out.shape == (sum(counts), 128)
        if sum(counts):
            close(out, want_out, 1e-5)
            close(dx, want_dx, 1e-5)
            close(dw.transpose(1, 2), want_dw, 1e-5)
        assert torch.count_nonzero(dw[[0, 2]]) == 0  # experts without rows: zero gradients


def test_options_keep_bf16_backward_gemms():
    x, stored, grad, offsets = operands(COUNTS, k=256, n=384, dtype=torch.float32)
    recipe = Fp8Recipe(granularity="rowwise", fp8_dgrad=False, fp8_wgrad=False)
    _, dx, dw = run(x, stored, grad, offsets, recipe, "torch")
    _, want_dx, want_dw = exact(x, stored.transpose(1, 2), grad, COUNTS)
    close(dx, want_dx, 1e-5)
    close(dw.transpose(1, 2), want_dw, 1e-5)


def test_input_errors_are_named():
    x, stored, _, offsets = operands([2, 3], k=192, n=128, dtype=torch.bfloat16)
    w = stored.transpose(1, 2)
    with pytest.raises(ValueError, match="multiples of 128; got K=192"):
        dist_moe.grouped_mm_fp8(x, w, offsets, recipe="blockwise")
    dist_moe.grouped_mm_fp8(x, w, offsets, recipe="rowwise")  # rowwise takes any K and N
    with pytest.raises(ValueError, match="recipe must be"):
        dist_moe.grouped_mm_fp8(x, w, offsets, recipe="tensorwise")
    with pytest.raises(ValueError, match="granularity"):
        Fp8Recipe(granularity="mxfp8")
    with pytest.raises(ValueError, match="grad_format"):
        Fp8Recipe(grad_format="e3m4")
    with pytest.raises(TypeError, match="share one dtype"):
        dist_moe.grouped_mm_fp8(x.double(), w.double(), offsets)
    with pytest.raises(ValueError, match="end at T=5"):
        dist_moe.grouped_mm_fp8(x, w, torch.tensor([1, 4], dtype=torch.int32))


cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                          reason="needs a CUDA GPU with fp8 tensor cores (sm_89+) for the Triton fp8 kernels")


@cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_quantize_matches_float64_rounding_on_gpu(fmt, dtype, backend):
    """Scales and fp8 values on the GPU bit for bit the float64 reference's (the CUDA division by a Python
    scalar had put scales an ulp off, and with them single fp8 values a whole step)."""
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(1024, 512, generator=gen) * torch.logspace(-4, 3, 1024).reshape(-1, 1)
    for blocks in ((1, 512), (1, 128), (128, 128), (128, 1)):
        q, scale = quantize_blocks(t.cuda(), *blocks, dtype, backend)
        want_scale = block_scales(t, *blocks, fmt)
        assert torch.equal(scale.cpu().double(), want_scale), blocks
        wide = want_scale.repeat_interleave(blocks[0], 0).repeat_interleave(blocks[1], 1)
        assert torch.equal(q.cpu().double(), round_to_format(quotient(t, wide), fmt)), blocks


@cuda
@pytest.mark.parametrize("granularity", ["rowwise", "blockwise"])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_triton_matches_float64_on_gpu(granularity, grad_format):
    counts = [0, 300, 17, 0, 1000, 129, 128, 1]
    x, stored, grad, offsets = operands(counts, k=512, n=384, dtype=torch.float32, device="cuda")
    recipe = Fp8Recipe(granularity=granularity, grad_format=grad_format)
    got = run(x, stored, grad, offsets, recipe, "triton")
    want = reference(x.cpu(), stored.cpu().transpose(1, 2), grad.cpu(), counts, granularity, grad_format)
    # 4e-3 of the output's largest value, not 1e-5: Hopper's fp8 wgmma keeps its accumulator in 13 mantissa bits
    # (truncated; e8m13, DeepSeek-V3's "~14 bits") and triton's sm_90 default never promotes it to float32
    # (max_num_imprecise_acc = 2^30). A float64 model of that (tools/bench/moe/fp8_dgrad_error_model.py: each
    # k32 step's products and the accumulator aligned to the largest, truncated 13 bits below it) gives dx
    # 1.2e-3 (e4m3, as the H200 measured) and 1.0e-3 (e5m2) rowwise, 2.6e-4 blockwise: 4e-3 is 3x the largest.
    # Before fp8_quant.scale_of, scales an ulp off put single fp8 values a step off (the torch path with the old
    # scales gives, exactly, the H200's e5m2 dx 7.2e-3 and e4m3 dw 5.5e-4 rowwise, and out 2.0e-3 blockwise).
    # A wrong scale, block index or row would be off by > 1e-2.
    for g, w_ in zip((got[0], got[1], got[2].transpose(1, 2)), want):
        close(g.cpu(), w_, 4e-3)


@cuda
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_triton_bf16_matches_torch_path_on_gpu(recipe):
    counts = [0, 300, 17, 0, 1000, 129, 128, 1]
    x, stored, grad, offsets = operands(counts, k=2048, n=1408, dtype=torch.bfloat16, device="cuda")
    got = run(x, stored, grad, offsets, recipe, "triton")
    want = run(x, stored, grad, offsets, recipe, "torch")
    for g, w_ in zip(got, want):  # same fp8 values; float32 sums in another order, then bf16 rounding
        close(g.float(), w_.double(), 2 ** -7)


@pytest.mark.parametrize("quantize", ["fp8_rowwise", "fp8_blockwise"])
def test_expert_mlp_fp8_against_float64_per_token(quantize):
    """The fp8 experts' plumbing (gather, three grouped_mm_fp8, SwiGLU, weighted slot sum): against
    the unquantised per-token float64 reference, within fp8's error (the GEMMs themselves are
    checked exactly above); a wrong slot, expert or weight would be off by O(1)."""
    from test_expert_mlp import make_case, per_token_reference

    ids, row_slot, offsets, mine, ref, grad = make_case(rows=40, top_k=3, num_experts=5, dim=128, ffn=256,
                                                        device="cpu", dtype=torch.float32, starve=(2,))
    out = dist_moe.expert_mlp(mine["x"], mine["w1"], mine["w2"], mine["w3"], offsets, row_slot, top_k=3,
                              weights=mine["weights"], quantize=quantize)
    out.backward(grad)
    want = per_token_reference(ref["x"], ref["w1"], ref["w2"], ref["w3"], ids, ref["weights"])
    want.backward(grad.double())
    pairs = {"out": (out, want)} | {k: (mine[k].grad, ref[k].grad) for k in mine}
    for name, (got, expected) in pairs.items():
        rel = ((got.double() - expected).norm() / expected.norm()).item()
        assert 1e-4 < rel < 0.1, f"{name}: relative error {rel:.3e}"  # > 1e-4: it did quantise
    assert torch.count_nonzero(mine["w1"].grad[2]) == 0  # the starved expert


def test_moe_config_quantize_option():
    torch.manual_seed(0)
    config = dist_moe.MoEConfig(dim=128, num_experts=4, top_k=2, expert_dim=128)
    bf16_moe, fp8_moe = config.build(), dist_moe.MoEConfig.like(config, dim=128, quantize="fp8_blockwise").build()
    fp8_moe.load_state_dict(bf16_moe.state_dict())
    x = torch.randn(2, 24, 128)
    want, got = bf16_moe(x), fp8_moe(x)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.1
    with pytest.raises(ValueError, match="quantize must be one of"):
        dist_moe.MoEConfig(dim=128, num_experts=4, top_k=2, expert_dim=128, quantize="mxfp8")


@cuda
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_triton_path_makes_no_host_sync_on_gpu(recipe, assert_no_host_sync):
    counts = [0, 300, 17, 0, 1000, 129, 128, 1]
    x, stored, grad, offsets = operands(counts, k=256, n=384, dtype=torch.bfloat16, device="cuda")
    x.requires_grad_(), stored.requires_grad_()

    def step():
        out = dist_moe.grouped_mm_fp8(x, stored.transpose(1, 2), offsets, recipe=recipe, backend="triton")
        out.backward(grad)

    step()  # compile outside the checked step
    assert_no_host_sync(step)


@cuda
@pytest.mark.parametrize("quantize", ["fp8_rowwise", "fp8_blockwise"])
def test_moe_quantize_on_gpu(quantize):
    torch.manual_seed(0)
    config = dist_moe.MoEConfig(dim=2048, num_experts=8, top_k=2, expert_dim=1408)
    bf16_moe = config.build().cuda().bfloat16()
    fp8_moe = dist_moe.MoEConfig.like(config, dim=2048, quantize=quantize).build().cuda().bfloat16()
    fp8_moe.load_state_dict(bf16_moe.state_dict())
    x = torch.randn(2, 512, 2048, device="cuda", dtype=torch.bfloat16)
    want, got = bf16_moe(x), fp8_moe(x)
    got.float().square().sum().backward()
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert 1e-3 < rel < 0.1, rel
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fp8_moe.experts.parameters())
