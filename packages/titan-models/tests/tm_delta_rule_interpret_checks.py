"""The Triton delta-rule kernels under TRITON_INTERPRET=1 (CPU, float32) against the float64 recurrence.

Run by test_gated_delta_rule_triton.py in a subprocess (the interpreter must be chosen before triton is
imported); prints one JSON object {check name: relative error}. Cases: several chunks with a tail and an
initial state (gradients of the output and the final state); packed documents (boundaries at, inside and
just after chunk edges, one-token documents) with two value blocks; one exact chunk with two key blocks
whose loss reads only the output (no final-state gradient); keys nearly parallel with beta near 1 (a
triangular system far from the identity).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from tm_delta_rule_reference import float64_delta_rule  # noqa: E402

from titan_models.components.gated_deltanet import l2_normalize  # noqa: E402
from titan_models.kernels.gated_delta_rule import triton_chunked_delta_rule  # noqa: E402

# Integer-overflow checks of every interpreted op cost time and test nothing here.
interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                              sanitize_overflow=False)
torch.set_num_threads(1)
results: dict[str, float] = {}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(b, s, h, dk, dv, seed, correlated=False):
    """Random inputs; `correlated`: keys and queries near one direction, slow decay and beta near 1, so the
    in-chunk triangular system is far from the identity (its inverse has large entries)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, h, dk, generator=gen) if correlated else 0.0
    spread = 0.2 if correlated else 1.0
    q = l2_normalize(base + spread * torch.randn(b, s, h, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(base + spread * torch.randn(b, s, h, dk, generator=gen))
    v = torch.randn(b, s, h, dv, generator=gen)
    if correlated:
        g = -0.02 * torch.rand(b, s, h, generator=gen)
        beta = 0.9 + 0.1 * torch.rand(b, s, h, generator=gen)
    else:
        g = -F.softplus(torch.randn(b, s, h, generator=gen))
        beta = torch.rand(b, s, h, generator=gen)
    initial = torch.randn(b, h, dk, dv, generator=gen)
    return [q, k, v, g, beta, initial], gen


def reference(tensors, lengths, with_initial):
    """float64 outputs and final state, each document run alone (the state restarts from zero)."""
    q, k, v, g, beta, initial = tensors
    outs, start, state = [], 0, None
    for i, n in enumerate(lengths):
        part = [t[:, start:start + n] for t in (q, k, v, g, beta)]
        out, state = float64_delta_rule(*part, initial if with_initial and i == 0 else None)
        outs.append(out)
        start += n
    return torch.cat(outs, dim=1), state


def check(name, b, h, dk, dv, lengths, *, with_initial, state_loss, seed, correlated=False):
    tensors, gen = inputs(b, sum(lengths), h, dk, dv, seed, correlated)
    ours = [t.clone().requires_grad_() for t in tensors]
    ref = [t.double().clone().requires_grad_() for t in tensors]
    segments = None if len(lengths) == 1 else torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    out, state = triton_chunked_delta_rule(*ours[:5], segments=segments,
                                           initial_state=ours[5] if with_initial else None)
    ref_out, ref_state = reference(ref, lengths, with_initial)
    results[f"{name}_out"], results[f"{name}_state"] = rel_err(out, ref_out), rel_err(state, ref_state)
    w_out, w_state = torch.randn(out.shape, generator=gen), torch.randn(state.shape, generator=gen)
    loss = (out * w_out).sum() + ((state * w_state).sum() if state_loss else 0)
    ref_loss = (ref_out * w_out.double()).sum() + ((ref_state * w_state.double()).sum() if state_loss else 0)
    loss.backward()
    ref_loss.backward()
    if segments is not None:  # control: without the boundaries the documents leak into each other
        with torch.no_grad():
            leaked, _ = triton_chunked_delta_rule(*tensors[:5])
        results[f"{name}_control_without_segments"] = rel_err(leaked, ref_out.detach())
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if with_initial else [])
    for i, grad_name in enumerate(names):
        results[f"{name}_grad_{grad_name}"] = rel_err(ours[i].grad, ref[i].grad)


check("chunks_with_tail", 2, 1, 16, 32, (150,), with_initial=True, state_loss=True, seed=0)
check("packed_documents", 1, 1, 32, 128, (1, 63, 2, 70, 30), with_initial=False, state_loss=True, seed=1)
check("correlated_keys", 1, 1, 32, 32, (130,), with_initial=True, state_loss=True, seed=3, correlated=True)
check("one_chunk_output_only", 1, 1, 128, 16, (64,), with_initial=True, state_loss=False, seed=2)


def check_layer():
    """The Gated DeltaNet layer (GQA heads, packed documents) with delta_rule_backend "triton" against
    "torch": output and input gradient."""
    from titan_models.components.gated_deltanet import GatedDeltaNetConfig
    from titan_models.context import AttentionContext

    outs, grads = {}, {}
    x = torch.randn(1, 90, 32, generator=torch.Generator().manual_seed(3))
    context = AttentionContext(document_ids=torch.cat([torch.zeros(40), torch.ones(50)]).long()[None])
    for backend in ("triton", "torch"):
        layer = GatedDeltaNetConfig(num_key_heads=1, num_value_heads=2, key_head_dim=16, value_head_dim=16,
                                    delta_rule_backend=backend).build(32)
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        xi = x.clone().requires_grad_()
        outs[backend] = layer(xi, context=context)
        outs[backend].square().sum().backward()
        grads[backend] = xi.grad
    results["layer_triton_vs_torch_out"] = rel_err(outs["triton"], outs["torch"])
    results["layer_triton_vs_torch_grad_x"] = rel_err(grads["triton"], grads["torch"])


def check_repeated_launches():
    """On a GPU the autotuner launches each kernel several times on the same buffers before keeping one
    config; every launch running twice must give the same gradients bitwise (no kernel reads what it writes)."""
    from titan_models.kernels import gated_delta_rule_kernels as kern

    tensors, _ = inputs(1, 100, 1, 16, 16, seed=4)
    segments = torch.cat([torch.zeros(30), torch.ones(70)]).long()[None]

    def grads():
        ours = [t.clone().requires_grad_() for t in tensors]
        out, state = triton_chunked_delta_rule(*ours[:5], segments=segments, initial_state=ours[5])
        (out.sum() + state.square().sum()).backward()
        return [t.grad for t in ours]

    once = grads()
    saved = {name: getattr(kern, name) for name in dir(kern) if name.endswith("_kernel")}

    class Twice:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.kernel[grid](*args, **kwargs)
                self.kernel[grid](*args, **kwargs)
            return launch

    for name, kernel in saved.items():
        setattr(kern, name, Twice(kernel))
    try:
        twice = grads()
    finally:
        for name, kernel in saved.items():
            setattr(kern, name, kernel)
    results["repeated_launches_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(once, twice))


def check_bf16_forward():
    """bf16 q, k, v: the autograd forward's bf16 path (bf16 buffers, products of bf16-rounded operands, here
    in float32 as the interpreter's bf16 tl.dot is wrong) on three chunks and two scan V blocks, against
    float64 on the same rounded inputs (measured 9.5e-3 and 1.1e-2: bf16 W, U, S, Unew and products, as
    fla-core 0.6 rounds them); and its backward (the float32 recompute) against float64's."""
    tensors, gen = inputs(1, 150, 1, 32, 64, seed=5)
    tensors = [t.bfloat16() if i < 3 else t for i, t in enumerate(tensors)]
    ours = [t.clone().requires_grad_() for t in tensors]
    ref = [t.double().clone().requires_grad_() for t in tensors]
    out, state = triton_chunked_delta_rule(*ours[:5], initial_state=ours[5])
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32, (out.dtype, state.dtype)  # as fla's
    ref_out, ref_state = float64_delta_rule(*ref[:5], ref[5])
    results["bf16_forward_out"], results["bf16_forward_state"] = rel_err(out, ref_out), rel_err(state, ref_state)
    w_out = torch.randn(out.shape, generator=gen)
    (out * w_out).sum().backward()
    (ref_out * w_out.double()).sum().backward()
    results["bf16_forward_grad_g"] = rel_err(ours[3].grad, ref[3].grad)  # float32, unlike q/k/v's grads
    with torch.no_grad():  # bf16_forward=False: float32 buffers and products, as backward's recompute
        kept, _ = triton_chunked_delta_rule(*tensors[:5], initial_state=tensors[5], bf16_forward=False)
    assert kept.dtype == torch.float32, kept.dtype
    results["bf16_inputs_tf32_forward_out"] = rel_err(kept, ref_out.detach())


def check_qk_l2norm():
    """qk_l2norm=True: raw q, k (norms far from 1, one row of zeros: eps keeps it finite) normalised by the
    op's own Triton launch, against float64 l2_normalize (q scaled by dk^-1/2) then the recurrence; the
    gradients of the raw q and k go through the normalisation's backward kernel."""
    tensors, gen = inputs(2, 100, 2, 32, 16, seed=6)
    raw_q, raw_k = (3.0 * torch.randn(tensors[0].shape, generator=gen) for _ in range(2))
    raw_k[0, 5, 1] = 0.0
    tensors = [raw_q, raw_k, *tensors[2:]]
    ours = [t.clone().requires_grad_() for t in tensors]
    ref = [t.double().clone().requires_grad_() for t in tensors]
    segments = torch.cat([torch.zeros(70), torch.ones(30)]).long()[None].expand(2, -1)
    out, state = triton_chunked_delta_rule(*ours[:5], segments=segments, initial_state=ours[5], qk_l2norm=True)
    ref_q, ref_k = l2_normalize(ref[0]) * 32**-0.5, l2_normalize(ref[1])
    ref_out, ref_state = reference([ref_q, ref_k, *ref[2:]], (70, 30), with_initial=True)
    results["qk_l2norm_out"], results["qk_l2norm_state"] = rel_err(out, ref_out), rel_err(state, ref_state)
    w_out, w_state = torch.randn(out.shape, generator=gen), torch.randn(state.shape, generator=gen)
    ((out * w_out).sum() + (state * w_state).sum()).backward()
    ((ref_out * w_out.double()).sum() + (ref_state * w_state.double()).sum()).backward()
    for i, name in enumerate(["q", "k", "v", "g", "beta", "initial_state"]):
        results[f"qk_l2norm_grad_{name}"] = rel_err(ours[i].grad, ref[i].grad)


check_layer()
check_repeated_launches()
check_bf16_forward()
check_qk_l2norm()
print(json.dumps(results))
