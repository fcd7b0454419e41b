"""expert_mlp (gather, SwiGLU experts, weighted combine) against a per-token float64 reference.

Tolerances, relative to the reference's largest entry: float64 1e-12, float32 1e-5, bfloat16 3e-2
(three chained bf16 GEMMs with float32 accumulation; h and the slot outputs are rounded to bf16).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_moe

RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def per_token_reference(x, w1, w2, w3, expert_ids, weights):
    outs = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            acc = acc + (1.0 if weights is None else weights[t, j]) * (w2[e] @ h)
        outs.append(acc)
    return torch.stack(outs)


def make_case(rows, top_k, num_experts, dim, ffn, device, dtype, *, starve=(), with_weights=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in starve])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(rows)])
    flat = ids.flatten()
    row_slot = flat.argsort(stable=True)
    offsets = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    params = {
        "x": torch.randn(rows, dim, generator=gen),
        "w1": torch.randn(num_experts, ffn, dim, generator=gen) / dim**0.5,
        "w2": torch.randn(num_experts, dim, ffn, generator=gen) / ffn**0.5,
        "w3": torch.randn(num_experts, ffn, dim, generator=gen) / dim**0.5,
    }
    if with_weights:
        params["weights"] = torch.rand(rows, top_k, generator=gen)
    grad = torch.randn(rows, dim, generator=gen)
    to = lambda t, dt: t.detach().to(device=device, dtype=dt, copy=True)  # noqa: E731
    weight_dtype = torch.promote_types(dtype, torch.float32)  # routing weights stay float32 (or float64)
    mine = {k: to(v, dtype if k != "weights" else weight_dtype).requires_grad_() for k, v in params.items()}
    ref = {k: to(v, torch.float64).requires_grad_() for k, v in params.items()}
    return ids, row_slot.to(device), offsets.to(device), mine, ref, grad


def run(backend, device, dtype, keep_routed_input=False, **case):
    ids, row_slot, offsets, mine, ref, grad = make_case(device=device, dtype=dtype, **case)
    top_k = ids.shape[1]
    out = dist_moe.expert_mlp(mine["x"], mine["w1"], mine["w2"], mine["w3"], offsets, row_slot, top_k=top_k,
                              weights=mine.get("weights"), backend=backend, keep_routed_input=keep_routed_input)
    out.backward(grad.to(device, dtype))
    want = per_token_reference(ref["x"], ref["w1"], ref["w2"], ref["w3"], ids, ref.get("weights"))
    want.backward(grad.to(device, torch.float64))
    pairs = {"out": (out, want.detach())} | {f"grad_{k}": (mine[k].grad, ref[k].grad) for k in mine}
    for name, (got, expected) in pairs.items():
        err = (got.double() - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert err <= RTOL[dtype] * scale, f"{name}: error {err:.3e}, scale {scale:.3e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_path_top2_weighted_with_empty_experts(dtype):
    run("torch", "cpu", dtype, rows=13, top_k=2, num_experts=6, dim=8, ffn=12, starve=(1, 4))


def test_torch_path_top1_unweighted():
    run("torch", "cpu", torch.float64, rows=9, top_k=1, num_experts=4, dim=8, ffn=6, with_weights=False)


def test_no_rows_still_gives_zero_weight_gradients():
    w = {k: torch.randn(3, *s, requires_grad=True) for k, s in (("w1", (5, 4)), ("w2", (4, 5)), ("w3", (5, 4)))}
    out = dist_moe.expert_mlp(torch.zeros(0, 4), w["w1"], w["w2"], w["w3"], torch.zeros(3, dtype=torch.int32),
                              torch.zeros(0, dtype=torch.int64), backend="torch")
    out.sum().backward()
    assert out.shape == (0, 4)
    assert all(t.grad is not None and not t.grad.any() for t in w.values())


def test_shape_errors_are_named():
    x, w1, w2 = torch.randn(4, 8), torch.randn(2, 6, 8), torch.randn(2, 8, 6)
    offsets, slot = torch.tensor([4, 8], dtype=torch.int32), torch.arange(8)
    with pytest.raises(ValueError, match="w2 \\[E, dim, ffn\\]"):
        dist_moe.expert_mlp(x, w1, w1, w1, offsets, slot, top_k=2)
    with pytest.raises(ValueError, match="row_slot must be"):
        dist_moe.expert_mlp(x, w1, w2, w1, offsets, slot, top_k=1)
    with pytest.raises(ValueError, match="weights must be"):
        dist_moe.expert_mlp(x, w1, w2, w1, offsets, slot, top_k=2, weights=torch.rand(4, 1))
    with pytest.raises(TypeError, match="keep_routed_input must be a bool"):
        dist_moe.expert_mlp(x, w1, w2, w1, offsets, slot, top_k=2, keep_routed_input="yes")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")


@cuda
@pytest.mark.parametrize("keep_routed_input", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_path_on_gpu(dtype, keep_routed_input):
    run("triton", "cuda", dtype, keep_routed_input, rows=300, top_k=4, num_experts=8, dim=256, ffn=192, starve=(2,))
    run("triton", "cuda", dtype, keep_routed_input, rows=70, top_k=1, num_experts=3, dim=136, ffn=72,
        with_weights=False)


@cuda
def test_triton_path_makes_no_host_sync_on_gpu(assert_no_host_sync):
    ids, row_slot, offsets, mine, _, grad = make_case(300, 4, 8, 256, 192, "cuda", torch.bfloat16)
    grad = grad.to("cuda", torch.bfloat16)  # a copy from pageable host memory synchronises: before, not inside
    args = (mine["x"], mine["w1"], mine["w2"], mine["w3"], offsets, row_slot)

    def step():
        dist_moe.expert_mlp(*args, top_k=4, weights=mine["weights"]).backward(grad)

    step()  # compiles (and would tune) every kernel first
    assert_no_host_sync(step)


@cuda
def test_every_candidate_on_gpu(monkeypatch):
    """Each shipped tile configuration (the first-call tuner may pick any) against float64: the
    fused MLP (every row role, the padded weight gradient) and grouped_mm (pointer weight gradient)."""
    from dist_moe.kernels import configs, launch

    rows_of = {role: configs.row_candidates(role, torch.device("cuda"), torch.bfloat16) for role in configs.ROLES}
    weights_of = {tma: configs.weight_candidates(torch.device("cuda"), torch.bfloat16, tma=tma)
                  for tma in (False, True)}
    depth = max(len(v) for v in [*rows_of.values(), *weights_of.values()])
    for index in range(depth):
        monkeypatch.setattr(launch, "row_candidates",
                            lambda role, device, dtype=None: [rows_of[role][min(index, len(rows_of[role]) - 1)]])
        monkeypatch.setattr(launch, "weight_candidates", lambda device, dtype=None, *, tma=False:
                            [weights_of[tma][min(index, len(weights_of[tma]) - 1)]])
        configs._chosen.clear()
        for keep in (False, True):  # the gate/up GEMM's "dual" role gathers, "dual_tma" reads the kept copy
            run("triton", "cuda", torch.bfloat16, keep, rows=200, top_k=4, num_experts=6, dim=256, ffn=256,
                starve=(2,))
        run_grouped_mm_case()
    configs._chosen.clear()


def run_grouped_mm_case():
    counts = [0, 300, 17, 0, 129]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 256, generator=gen).cuda().bfloat16().requires_grad_()
    stored = torch.randn(len(counts), 384, 256, generator=gen).cuda().bfloat16().requires_grad_()  # Linear [E, N, K]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = dist_moe.grouped_mm(x, stored.transpose(1, 2), offsets, backend="triton")
    grad = torch.randn(out.shape, generator=gen).cuda().bfloat16()
    out.backward(grad)
    xr, wr = x.detach().double().requires_grad_(), stored.detach().double().requires_grad_()
    pieces, start = [], 0
    for e, c in enumerate(counts):
        pieces.append(xr[start:start + c] @ wr[e].T)
        start += c
    want = torch.cat(pieces)
    want.backward(grad.double())
    for name, got, expected in (("out", out, want), ("grad_x", x.grad, xr.grad), ("grad_w", stored.grad, wr.grad)):
        err = (got.double() - expected).abs().max().item()
        assert err <= 2e-2 * expected.abs().max().item(), f"grouped_mm {name}: error {err:.3e}"


@cuda
def test_warp_specialized_weight_gradient_takes_only_the_checked_row_step():
    """block_r=32 gave NaN on an H100 (triton 3.6), so the launcher refuses row steps other than the one
    checked on a GPU; the checked one (the tuner's third TMA candidate) runs and matches float64."""
    from dist_moe.kernels.configs import WeightConfig
    from dist_moe.kernels.launch import TileMaps, gather_rows, weight_gemm

    counts = [100, 0, 320, 64]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    maps = TileMaps(offsets, sum(counts))
    identity = torch.arange(sum(counts), device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    p_rows, q_rows = (torch.randn(sum(counts), n, generator=gen, device="cuda").bfloat16() for n in (256, 256))
    p, q = gather_rows(p_rows, identity, 1, maps), gather_rows(q_rows, identity, 1, maps)
    out = torch.full((len(counts), 256, 256), float("nan"), device="cuda", dtype=torch.bfloat16)

    def config(block_r):
        return WeightConfig(block_k=128, block_n=256, block_r=block_r, num_warps=4, num_stages=3, persistent=True,
                            store_tma=True, warp_specialize=True)
    with pytest.raises(ValueError, match="block_r=64"):
        weight_gemm(p=p, q=q, ends=maps.padded_ends(), outs=(out,), padded=True, config=config(32))
    weight_gemm(p=p, q=q, ends=maps.padded_ends(), outs=(out,), padded=True, config=config(64))
    start = 0
    for e, c in enumerate(counts):
        want = p_rows[start:start + c].double().T @ q_rows[start:start + c].double()
        start += c
        err = (out[e].double() - want).abs().max().item()
        assert err <= 2e-2 * max(want.abs().max().item(), 1.0), f"expert {e}: error {err:.3e}"
