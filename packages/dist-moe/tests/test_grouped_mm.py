"""grouped_mm against a per-expert loop in float64 (torch path on CPU; Triton on CUDA when present).

Tolerances, relative to the reference's largest entry: float64 1e-12, float32 1e-5, bfloat16 2e-2
(inputs rounded to bf16, float32 accumulation, output rounded to bf16).
"""
from __future__ import annotations

import pytest
import torch

import dist_moe

RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(x, w, counts):
    """Forward and gradients by a plain loop, in float64."""
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(xr[start:start + c] @ wr[e])
        start += c
    return torch.cat(out), xr, wr


def close(got, want, dtype):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= RTOL[dtype] * want.abs().max().item(), f"error {err:.3e} vs scale {want.abs().max().item():.3e}"


def run_case(dtype, device, backend, counts, k, n, linear_layout):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(sum(counts), k, generator=gen).to(device, dtype).requires_grad_()
    if linear_layout:  # a Linear-style [E, N, K] parameter seen as [E, K, N]
        stored = torch.randn(len(counts), n, k, generator=gen).to(device, dtype).requires_grad_()
        w = stored.transpose(1, 2)
    else:
        stored = torch.randn(len(counts), k, n, generator=gen).to(device, dtype).requires_grad_()
        w = stored
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    out = dist_moe.grouped_mm(x, w, offsets, backend=backend)
    grad = torch.randn(out.shape, generator=gen).to(device, dtype)
    out.backward(grad)
    want, xr, wr = reference(x, w, counts)
    want.backward(grad.double())
    close(out, want, dtype)
    close(x.grad, xr.grad, dtype)
    close(stored.grad if not linear_layout else stored.grad.transpose(1, 2), wr.grad, dtype)
    assert stored.grad.stride() == stored.stride()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear_layout", [True, False])
def test_torch_path_matches_loop(dtype, linear_layout):
    run_case(dtype, "cpu", "torch", [3, 0, 8, 1, 0], k=12, n=7, linear_layout=linear_layout)


def test_all_groups_empty_but_one():
    run_case(torch.float32, "cpu", "torch", [0, 0, 6, 0], k=5, n=4, linear_layout=True)


def test_input_errors_are_named():
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="K=2 columns"):
        dist_moe.grouped_mm(torch.randn(4, 2), w, torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets must be"):
        dist_moe.grouped_mm(x, w, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="end at T=4"):
        dist_moe.grouped_mm(x, w, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="one floating dtype"):
        dist_moe.grouped_mm(x, w.double(), torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        dist_moe.grouped_mm(x, w, torch.tensor([1, 4], dtype=torch.int32), backend="cuda")


def test_triton_backend_refuses_cpu_tensors(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA tensors"):
        dist_moe.grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 4], dtype=torch.int32),
                            backend="triton")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("linear_layout", [True, False])
def test_triton_matches_loop_on_gpu(dtype, linear_layout):
    counts = [0, 300, 17, 0, 1000, 129, 64, 1]
    run_case(dtype, "cuda", "triton", counts, k=512, n=384, linear_layout=linear_layout)
    run_case(dtype, "cuda", "triton", counts, k=200, n=72, linear_layout=linear_layout)  # tails


@cuda
def test_every_row_config_on_gpu():
    from dist_moe.kernels.configs import RowConfig, row_candidates
    from dist_moe.kernels.launch import RowOperands, row_gemm

    counts = [130, 0, 257, 5]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(sum(counts), 256, generator=gen).cuda().bfloat16()
    linear_w = torch.randn(4, 512, 256, generator=gen).cuda().bfloat16()
    want, _, _ = reference(x, linear_w.transpose(1, 2), counts)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    configs = row_candidates("plain", x.device) + [
        RowConfig(block_m=128, block_n=128, block_k=64, persistent=True, tma=True, num_stages=3)]
    for config in configs:
        out = torch.full((x.shape[0], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        row_gemm(RowOperands(a=x, b=linear_w.transpose(1, 2), offsets=offsets, out=out, num_rows=x.shape[0]),
                 config)
        close(out, want, torch.bfloat16)
