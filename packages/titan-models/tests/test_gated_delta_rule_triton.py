"""The Triton chunked delta rule (titan_models/kernels/gated_delta_rule.py): forward and gradients of q, k,
v, beta, g and the initial state against the float64 recurrence, packed documents against each document
alone. On CPU through TRITON_INTERPRET=1 in float32 (bf16 tl.dot is wrong in the interpreter), in one
subprocess (12-30 s: the interpreter runs each kernel op by op); on CUDA in float32 and bfloat16 (skipped
without a GPU). Also which backend the Gated DeltaNet layer picks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tm_delta_rule_reference import float64_delta_rule
from tm_reference import rel_err

from titan_models.components.gated_deltanet import GatedDeltaNetConfig, l2_normalize
from titan_models.kernels.gated_delta_rule import triton_chunked_delta_rule, use_triton

triton = pytest.importorskip("triton")

# float32 kernels against float64: a 64-token triangular inverse and a few chunks of state products
TOL = 2e-5
CASES = {
    "chunks_with_tail": ["q", "k", "v", "g", "beta", "initial_state"],
    "packed_documents": ["q", "k", "v", "g", "beta"],
    "one_chunk_output_only": ["q", "k", "v", "g", "beta", "initial_state"],
    "correlated_keys": ["q", "k", "v", "g", "beta", "initial_state"],
    "qk_l2norm": ["q", "k", "v", "g", "beta", "initial_state"],  # raw q, k normalised inside the op
}
# nearly parallel keys and a decay of ~0.01 per token: dg sums many cancelling terms (measured 1.5e-5; the
# torch form's dg is 3.5e-5 off there)
CASE_TOL = {"correlated_keys_grad_g": 5e-5}
EXPECTED = [f"{case}_{what}" for case, grads in CASES.items()
            for what in ["out", "state", *(f"grad_{g}" for g in grads)]] + [
    "layer_triton_vs_torch_out", "layer_triton_vs_torch_grad_x"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    script = Path(__file__).with_name("tm_delta_rule_interpret_checks.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# bf16 buffers and bf16-rounded operands in every product: ~1e-2 (the GPU test's bound is 2e-2), and above
# 1e-4, so the bf16 path did run; the gradient comes from backward's float32 recompute, but the output is
# bf16 (as fla's), so autograd hands backward a bf16-rounded dO (measured 1.9e-3 on dg; below 1e-4 with the
# float32 output before); bf16_forward=False keeps float32's accuracy on the rounded inputs
BF16_BOUNDS = {"bf16_forward_out": (1e-4, 2e-2), "bf16_forward_state": (1e-4, 2e-2),
               "bf16_forward_grad_g": (0.0, 5e-3), "bf16_inputs_tf32_forward_out": (0.0, TOL)}


def test_every_interpreted_check_ran(interpreted):
    assert sorted(interpreted) == sorted([*EXPECTED, *BF16_BOUNDS, "packed_documents_control_without_segments",
                                          "repeated_launches_max_abs_diff"])


@pytest.mark.parametrize("name", BF16_BOUNDS)
def test_interpreted_bf16_forward_path(interpreted, name):
    low, high = BF16_BOUNDS[name]
    assert low <= interpreted[name] < high, interpreted[name]


@pytest.mark.parametrize("name", EXPECTED)
def test_interpreted_kernels_match_float64(interpreted, name):
    assert interpreted[name] < CASE_TOL.get(name, TOL), interpreted[name]


def test_interpreted_kernels_survive_repeated_launches(interpreted):
    assert interpreted["repeated_launches_max_abs_diff"] == 0.0  # what the GPU autotuner's trial runs do


def test_interpreted_packed_control_leaks_without_segments(interpreted):
    assert interpreted["packed_documents_control_without_segments"] > 1e-2


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, v = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 32)
    per_head, per_channel = torch.zeros(1, 8, 2), torch.zeros(1, 8, 2, 16)
    assert not use_triton("auto", q, v, per_head, 64)  # CPU tensors: the torch form
    assert not use_triton("auto", q, v, per_channel, 64) and not use_triton("auto", q, v, per_head, 32)
    assert not use_triton("torch", q, v, per_head, 64)
    with pytest.raises(ValueError, match="per key channel"):
        use_triton("triton", q, v, per_channel, 64)
    with pytest.raises(ValueError, match="power of two"):
        use_triton("triton", torch.zeros(1, 8, 2, 24), v, per_head, 64)
    with pytest.raises(ValueError, match="CUDA"):
        use_triton("triton", q, v, per_head, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("triton", q, v, per_head, 64)
    with pytest.raises(ValueError, match="delta_rule_backend"):
        GatedDeltaNetConfig(num_key_heads=1, num_value_heads=1, key_head_dim=16, value_head_dim=16,
                            delta_rule_backend="fla").build(8)


def _gpu_inputs(b, s, h, dk, dv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = l2_normalize(torch.randn(b, s, h, dk, device="cuda", generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(b, s, h, dk, device="cuda", generator=gen))
    v = torch.randn(b, s, h, dv, device="cuda", generator=gen)
    g = -F.softplus(torch.randn(b, s, h, device="cuda", generator=gen))
    beta = torch.rand(b, s, h, device="cuda", generator=gen)
    initial = torch.randn(b, h, dk, dv, device="cuda", generator=gen)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta, initial]


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_gpu_kernels_match_float64(dtype, tol):
    lengths = (100, 64, 1, 300, 47)
    tensors = _gpu_inputs(2, sum(lengths), 4, 128, 128, dtype)
    segments = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(lengths)])[None].expand(2, -1)
    ours = [t.clone().requires_grad_() for t in tensors]
    out, state = triton_chunked_delta_rule(*ours[:5], segments=segments, initial_state=ours[5])
    ref = [t.double().clone().requires_grad_() for t in tensors]
    outs, start, ref_state = [], 0, None
    for i, n in enumerate(lengths):
        part = [t[:, start:start + n] for t in ref[:5]]
        o, ref_state = float64_delta_rule(*part, ref[5] if i == 0 else None)
        outs.append(o)
        start += n
    ref_out = torch.cat(outs, dim=1)
    assert rel_err(out, ref_out) < tol and rel_err(state, ref_state) < tol
    w_out, w_state = torch.randn_like(out), torch.randn_like(state)
    ((out * w_out).sum() + (state * w_state).sum()).backward()
    ((ref_out * w_out.double()).sum() + (ref_state * w_state.double()).sum()).backward()
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], ours, ref):
        assert rel_err(a.grad, b.grad) < tol, name


@cuda
def test_gpu_qk_l2norm_bf16_matches_float64():
    """bf16 raw q, k normalised inside the op (the layer's and the bench's call) against float64
    l2_normalize then the recurrence; out is bf16 (the bf16 forward's), gradients reach the raw q and k."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    tensors = _gpu_inputs(1, 300, 4, 128, 128, torch.bfloat16, seed=1)
    tensors[:2] = [(3 * torch.randn(1, 300, 4, 128, device="cuda", generator=gen)).bfloat16() for _ in range(2)]
    ours = [t.clone().requires_grad_() for t in tensors]
    out, state = triton_chunked_delta_rule(*ours[:5], initial_state=ours[5], qk_l2norm=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    ref = [t.double().clone().requires_grad_() for t in tensors]
    ref_out, ref_state = float64_delta_rule(l2_normalize(ref[0]) * 128**-0.5, l2_normalize(ref[1]), *ref[2:5], ref[5])
    assert rel_err(out, ref_out) < 2e-2 and rel_err(state, ref_state) < 2e-2
    w_out, w_state = torch.randn_like(out), torch.randn_like(state)
    ((out * w_out).sum() + (state * w_state).sum()).backward()
    ((ref_out * w_out.double()).sum() + (ref_state * w_state.double()).sum()).backward()
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], ours, ref):
        assert rel_err(a.grad, b.grad) < 2e-2, name


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_forward_bits_do_not_depend_on_tuned_config(monkeypatch, dtype):
    """The autotuner may keep different warps/stages in different processes (a trainer and a generator):
    the forward's out and final state must be bitwise the same under every config it can keep."""
    from titan_models.kernels import gated_delta_rule_kernels as kern

    tensors = _gpu_inputs(1, 300, 4, 128, 128, dtype, seed=2)
    names = ("prepare_kernel", "state_forward_kernel", "output_kernel")
    tuned = {name: getattr(kern, name) for name in names}

    class Fixed:  # launches the JIT function under one of the autotuner's configs
        def __init__(self, kernel, config):
            self.kernel, self.config = kernel, config

        def __getitem__(self, grid):
            return lambda *a, **kw: self.kernel.fn[grid](*a, **kw, num_warps=self.config.num_warps,
                                                        num_stages=self.config.num_stages)

    results = []
    for config in tuned["prepare_kernel"].configs:  # the same configs for every kernel
        for name in names:
            monkeypatch.setattr(kern, name, Fixed(tuned[name], config))
        with torch.no_grad():
            results.append(triton_chunked_delta_rule(*tensors[:5], initial_state=tensors[5]))
    for out, state in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(state, results[0][1])


@cuda
def test_gpu_layer_picks_triton_and_matches_torch_form(monkeypatch):
    import titan_models.components.gated_deltanet as gdn

    calls = []
    monkeypatch.setattr(gdn, "triton_chunked_delta_rule",
                        lambda *a, **kw: calls.append(1) or triton_chunked_delta_rule(*a, **kw))
    layers = {}
    for backend in ("auto", "torch"):
        torch.manual_seed(0)
        layers[backend] = GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=64,
                                              value_head_dim=64, delta_rule_backend=backend).build(128).cuda()
        with torch.no_grad():
            for p in layers[backend].parameters():
                p.normal_(0, 0.1)
    x = torch.randn(2, 200, 128, device="cuda")
    outs = {name: layer(x) for name, layer in layers.items()}
    assert calls == [1]  # "auto" ran the kernels on CUDA, "torch" did not
    assert rel_err(outs["auto"], outs["torch"]) < TOL
