"""dist-moe on one GPU at DeepSeek-V3 expert shapes: grouped GEMM and MoE layer, with anchors.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/moe/bench_moe.py

Shapes: hidden 7168, expert width 2048, 32 local experts, 32768 routed rows (4096 tokens x top-8),
routing uniform (1024 rows per expert) or skewed (Zipf over the experts), bf16.

Sections (each in its own subprocess, so a kernel that faults cannot take the others down; the
Triton cache on disk is shared between them):
  gemm   grouped GEMM forward, x [32768, K] @ w[e] [K, N] for gate/up (K=7168, N=2048) and down
         (K=2048, N=7168): a sweep of Triton configurations (tiles, warps, stages, L2 grouping,
         persistent or not, TMA descriptors), each checked against float64 first, then timed;
         plus dist_moe.grouped_mm as shipped (first-call tuning), torch._grouped_mm and a
         per-expert loop of torch.mm.
  layer  routed experts forward+backward: the usual pipeline (argsort permute, index gather,
         three torch._grouped_mm, SwiGLU, weighting, index_add_ scatter-add; backward by autograd
         with torch._grouped_mm for every product) against dist_moe's fused path (dispatch +
         expert_mlp); outputs and all gradients checked against float64 first.
  wgrad  the weight-gradient GEMM (out[e] = x_e^T dy_e) sweep against torch._grouped_mm.
Prints progress, the best configuration per shape and a final table; writes everything as JSON
to $OUT/moe_bench.json when OUT is set. --dry-run runs the same code on CPU through
TRITON_INTERPRET=1 with tiny float32 shapes (a check of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

# The layer (the headline comparison) runs first; the two sweeps share the time left, stopping early.
SECTIONS = ("layer", "gemm", "wgrad")
LAYER_TIMEOUT_S = 330  # compiling and tuning ~22 kernel variants takes most of it
BF16_RTOL = 1e-2  # bf16 output of a float32-accumulated GEMM vs float64, relative to the largest entry
LAYER_RTOL = 3e-2  # three chained bf16 GEMMs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=("all", *SECTIONS), default="all", help="run one section (default: all)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="time budget in seconds: of the whole run, or of --section (default 420)")
    p.add_argument("--json", type=Path, default=None, help="where a section writes its results (internal)")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes: checks the script")
    return p.parse_args()


# ----------------------------------------------------------------------------------------------
# Shared set-up


class Setup:
    def __init__(self, dry_run: bool):
        import torch

        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        if dry_run:
            self.rows, self.hidden, self.ffn, self.experts, self.tokens, self.top_k = 96, 32, 48, 4, 24, 4
        else:
            self.rows, self.hidden, self.ffn, self.experts, self.tokens, self.top_k = 32768, 7168, 2048, 32, 4096, 8

    def counts(self, routing: str) -> list[int]:
        """Rows per expert: uniform, or Zipf (p_e ~ 1/(e+1)) rounded to sum to `rows`."""
        e, rows = self.experts, self.rows
        if routing == "uniform":
            return [rows // e] * e
        weights = [1.0 / (i + 1) for i in range(e)]
        raw = [rows * w / sum(weights) for w in weights]
        counts = [int(r) for r in raw]
        for i in sorted(range(e), key=lambda i: raw[i] - counts[i], reverse=True)[: rows - sum(counts)]:
            counts[i] += 1
        return counts

    def offsets(self, counts):
        import torch

        return torch.tensor(counts, device=self.device).cumsum(0).to(torch.int32)

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn, reps: int = 10, warmup: int = 2) -> float:
        import torch

        if self.dry:  # interpreted kernels: one call shows the path works, timing means nothing
            reps, warmup = 1, 0

        for _ in range(warmup):
            fn()
        self.sync()
        if self.device.type != "cuda":
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) * 1e3 / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps


def rel_err(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def env_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def has_torch_grouped_mm() -> bool:
    import torch

    return hasattr(torch, "_grouped_mm")


# ----------------------------------------------------------------------------------------------
# Section: grouped GEMM forward sweep


def row_sweep(dry: bool):
    from dist_moe.kernels.configs import RowConfig

    if dry:
        return [RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1),
                RowConfig(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1, persistent=True,
                          flatten=True),
                RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1, tma=True)]
    tiles = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4),
             (128, 128, 64, 8, 4), (128, 128, 64, 4, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4)]
    configs = [RowConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s) for m, n, k, w, s in tiles]
    configs += [RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=g)
                for g in (1, 16, 32)]
    configs += [RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=s, persistent=True)
                for s in (3, 4)]
    configs += [RowConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, persistent=True, flatten=True)
                for m, n, k, w, s in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4)]]
    # TMA last: a descriptor problem on this triton should not cost the pointer-load results.
    configs += [RowConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, tma=True)
                for m, n, k, w, s in tiles[:6]]
    configs += [RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=s, persistent=True,
                          tma=True) for s in (3, 4)]
    configs += [RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True,
                          flatten=True, tma=True)]
    return configs


def section_gemm(setup: Setup, budget_s: float) -> dict:
    import torch

    import dist_moe
    from dist_moe.kernels.launch import RowOperands, row_gemm

    t0 = time.time()
    gen = torch.Generator(device=setup.device).manual_seed(0)  # on the GPU: 1e9 normals take seconds on CPU
    shapes = {"gate_up": (setup.hidden, setup.ffn), "down": (setup.ffn, setup.hidden)}
    cases = {}
    for shape, (k, n) in shapes.items():
        x = torch.randn(setup.rows, k, generator=gen, device=setup.device).to(setup.dtype)
        linear_w = (torch.randn(setup.experts, n, k, generator=gen, device=setup.device) * k**-0.5).to(setup.dtype)
        for routing in ("uniform", "skewed"):
            counts = setup.counts(routing)
            want, start = torch.empty(setup.rows, n, dtype=torch.float64, device=setup.device), 0
            for e, c in enumerate(counts):
                want[start:start + c] = x[start:start + c].double() @ linear_w[e].double().T
                start += c
            cases[(shape, routing)] = dict(x=x, w=linear_w.transpose(1, 2), counts=counts,
                                           offsets=setup.offsets(counts), want=want,
                                           flops=2.0 * setup.rows * k * n)
    print(f"[gemm] references ready ({time.time() - t0:.0f}s)", flush=True)

    result = {"sweep": [], "anchors": {}, "budget_reached": False}
    for config in row_sweep(setup.dry):
        if time.time() - t0 > budget_s:
            result["budget_reached"] = True
            print(f"[gemm] time budget reached; {config.name()} and later configs skipped", flush=True)
            break
        row = {"config": config.name(), "results": {}}
        try:
            for (shape, routing), c in cases.items():
                out = torch.empty_like(c["want"], dtype=setup.dtype)
                ops = RowOperands(a=c["x"], b=c["w"], offsets=c["offsets"], out=out, num_rows=setup.rows)
                row_gemm(ops, config)
                err = rel_err(out, c["want"])
                entry = {"err": err, "ok": err <= BF16_RTOL}
                if entry["ok"]:
                    ms = setup.time_ms(lambda: row_gemm(ops, config))
                    entry.update(ms=ms, tflops=c["flops"] / ms / 1e9)
                row["results"][f"{shape}/{routing}"] = entry
        except Exception as err:  # compile failure, shared memory, descriptor limits: record and go on
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        result["sweep"].append(row)
        summary = row.get("error") or "  ".join(
            f"{key} {v['tflops']:.0f}" if v["ok"] else f"{key} WRONG(err {v['err']:.1e})"
            for key, v in row["results"].items() if "tflops" in v or not v["ok"])
        print(f"[gemm] {config.name():40s} {summary}", flush=True)

    for (shape, routing), c in cases.items():
        key = f"{shape}/{routing}"
        anchors = {}
        try:
            out = dist_moe.grouped_mm(c["x"], c["w"], c["offsets"], backend="triton")  # first call tunes
            ms = setup.time_ms(lambda: dist_moe.grouped_mm(c["x"], c["w"], c["offsets"], backend="triton"))
            anchors["dist_moe.grouped_mm"] = {"ms": ms, "tflops": c["flops"] / ms / 1e9, "err": rel_err(out, c["want"])}
        except Exception as err:
            anchors["dist_moe.grouped_mm"] = {"error": f"{type(err).__name__}: {err}"[:300]}
        if has_torch_grouped_mm():
            try:
                out = torch._grouped_mm(c["x"], c["w"], offs=c["offsets"])
                ms = setup.time_ms(lambda: torch._grouped_mm(c["x"], c["w"], offs=c["offsets"]))
                anchors["torch._grouped_mm"] = {"ms": ms, "tflops": c["flops"] / ms / 1e9,
                                                "err": rel_err(out, c["want"])}
            except Exception as err:
                anchors["torch._grouped_mm"] = {"error": f"{type(err).__name__}: {err}"[:300]}
        bounds = [0]
        for count in c["counts"]:
            bounds.append(bounds[-1] + count)

        def loop():
            out = torch.empty(setup.rows, c["w"].shape[2], device=setup.device, dtype=setup.dtype)
            for e in range(setup.experts):
                torch.mm(c["x"][bounds[e]:bounds[e + 1]], c["w"][e], out=out[bounds[e]:bounds[e + 1]])
            return out

        ms = setup.time_ms(loop)
        anchors["per-expert loop"] = {"ms": ms, "tflops": c["flops"] / ms / 1e9, "err": rel_err(loop(), c["want"])}
        result["anchors"][key] = anchors
        print(f"[gemm] anchors {key}: " + "  ".join(
            f"{name} {v['tflops']:.0f}" if "tflops" in v else f"{name} {v['error']}" for name, v in anchors.items()),
            flush=True)
    from dist_moe.kernels.configs import chosen_configs

    result["tuned"] = {str(k): v.name() for k, v in chosen_configs().items()}
    return result


# ----------------------------------------------------------------------------------------------
# Section: weight-gradient GEMM sweep


def weight_sweep(dry: bool):
    from dist_moe.kernels.configs import WeightConfig

    if dry:
        return [WeightConfig(block_k=16, block_n=16, block_r=16, group_k=2, num_warps=4, num_stages=1),
                WeightConfig(block_k=32, block_n=16, block_r=32, group_k=1, num_warps=4, num_stages=1,
                             persistent=True, flatten=True)]
    tiles = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3), (128, 256, 32, 8, 4),
             (128, 128, 64, 4, 3), (128, 128, 32, 4, 4), (64, 256, 64, 4, 4), (128, 128, 128, 8, 3)]
    configs = [WeightConfig(block_k=k, block_n=n, block_r=r, num_warps=w, num_stages=s) for k, n, r, w, s in tiles]
    configs += [WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3, group_k=g)
                for g in (1, 32)]
    configs += [WeightConfig(block_k=k, block_n=n, block_r=r, num_warps=w, num_stages=s, persistent=True,
                             flatten=f) for k, n, r, w, s in [(128, 256, 64, 8, 3), (128, 128, 64, 4, 3)]
                for f in (False, True)]
    return configs


def section_wgrad(setup: Setup, budget_s: float) -> dict:
    import torch

    from dist_moe.kernels.launch import weight_gemm

    t0 = time.time()
    gen = torch.Generator(device=setup.device).manual_seed(1)
    # gate/up: x [rows, 7168], dy [rows, 2048] -> [E, 7168, 2048], stored as the Linear weight [E, 2048, 7168]
    shapes = {"gate_up": (setup.hidden, setup.ffn), "down": (setup.ffn, setup.hidden)}
    cases = {}
    for shape, (k, n) in shapes.items():
        p = torch.randn(setup.rows, k, generator=gen, device=setup.device).to(setup.dtype)
        q = torch.randn(setup.rows, n, generator=gen, device=setup.device).to(setup.dtype)
        for routing in ("uniform", "skewed"):
            counts = setup.counts(routing)
            want, start = torch.empty(setup.experts, k, n, dtype=torch.float64, device=setup.device), 0
            for e, c in enumerate(counts):
                want[e] = p[start:start + c].double().T @ q[start:start + c].double()
                start += c
            cases[(shape, routing)] = dict(p=p, q=q, offsets=setup.offsets(counts), want=want,
                                           flops=2.0 * setup.rows * k * n)
    print(f"[wgrad] references ready ({time.time() - t0:.0f}s)", flush=True)
    result = {"sweep": [], "anchors": {}, "budget_reached": False}
    for config in weight_sweep(setup.dry):
        if time.time() - t0 > budget_s:
            result["budget_reached"] = True
            print(f"[wgrad] time budget reached; {config.name()} and later configs skipped", flush=True)
            break
        row = {"config": config.name(), "results": {}}
        try:
            for (shape, routing), c in cases.items():
                e, k, n = c["want"].shape
                stored = torch.empty(e, n, k, device=setup.device, dtype=setup.dtype)  # Linear layout
                run = lambda: weight_gemm(p=c["p"], q=c["q"], offsets=c["offsets"],  # noqa: E731
                                          out=stored.transpose(1, 2), config=config)
                run()
                err = rel_err(stored.transpose(1, 2), c["want"])
                entry = {"err": err, "ok": err <= BF16_RTOL}
                if entry["ok"]:
                    ms = setup.time_ms(run)
                    entry.update(ms=ms, tflops=c["flops"] / ms / 1e9)
                row["results"][f"{shape}/{routing}"] = entry
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        result["sweep"].append(row)
        summary = row.get("error") or "  ".join(
            f"{key} {v['tflops']:.0f}" if v["ok"] else f"{key} WRONG(err {v['err']:.1e})"
            for key, v in row["results"].items())
        print(f"[wgrad] {config.name():36s} {summary}", flush=True)
    if has_torch_grouped_mm():
        for (shape, routing), c in cases.items():
            try:
                run = lambda: torch._grouped_mm(c["p"].t(), c["q"], offs=c["offsets"])  # noqa: E731
                out = run()
                ms = setup.time_ms(run)
                result["anchors"][f"{shape}/{routing}"] = {
                    "torch._grouped_mm": {"ms": ms, "tflops": c["flops"] / ms / 1e9, "err": rel_err(out, c["want"])}}
            except Exception as err:
                result["anchors"][f"{shape}/{routing}"] = {"torch._grouped_mm": {"error": f"{type(err).__name__}: {err}"[:300]}}
            print(f"[wgrad] anchor {shape}/{routing}: {result['anchors'][f'{shape}/{routing}']}", flush=True)
    return result


# ----------------------------------------------------------------------------------------------
# Section: MoE layer forward + backward


class _TorchGroupedMM:
    """torch._grouped_mm with its backward also through torch._grouped_mm (dx = dy w^T,
    dw[e] = x_e^T dy_e): the usual pipeline, independent of whether autograd knows the op."""

    @staticmethod
    def build():
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w, offsets):
                ctx.save_for_backward(x, w, offsets)
                return torch._grouped_mm(x, w, offs=offsets)

            @staticmethod
            def backward(ctx, grad):
                x, w, offsets = ctx.saved_tensors
                grad = grad.contiguous()
                dx = torch._grouped_mm(grad, w.transpose(1, 2), offs=offsets)
                try:
                    dw = torch._grouped_mm(x.t(), grad, offs=offsets)  # [E, K, N]
                except RuntimeError:  # a build that wants a row-major first operand
                    dw = torch._grouped_mm(x.t().contiguous(), grad, offs=offsets)
                return dx, dw, None

        return Fn


def baseline_grouped_mm(setup: Setup):
    """torch._grouped_mm with torch's own autograd when it has one (what training code relies
    on), else with the explicit backward above. Returns (function, description)."""
    import torch

    def native(x, w, offsets):
        return torch._grouped_mm(x, w, offs=offsets)

    try:
        x = torch.randn(64, 32, device=setup.device, dtype=setup.dtype, requires_grad=True)
        w = torch.randn(2, 16, 32, device=setup.device, dtype=setup.dtype, requires_grad=True)
        y = native(x, w.transpose(1, 2), torch.tensor([16, 64], device=setup.device, dtype=torch.int32))
        y.backward(torch.randn_like(y))
        assert x.grad is not None and w.grad is not None
        return native, "torch autograd"
    except Exception as err:
        print(f"[layer] torch._grouped_mm autograd unavailable ({type(err).__name__}: {err}); explicit backward",
              flush=True)
        return _TorchGroupedMM.build().apply, "explicit backward through torch._grouped_mm"


def usual_layer(x, w1, w2, w3, weights, expert_ids, num_experts, gmm):
    """argsort permute, index gather, three grouped GEMMs, SwiGLU, weighting, index_add_ scatter-add."""
    import torch
    import torch.nn.functional as F

    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order], bounds).to(torch.int32)
    token = order // top_k
    routed = x[token]  # gather [R, dim]
    h = F.silu(gmm(routed, w1.transpose(1, 2), offsets)) * gmm(routed, w3.transpose(1, 2), offsets)
    y = gmm(h, w2.transpose(1, 2), offsets)
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)  # scatter-add


def fused_layer(x, w1, w2, w3, weights, expert_ids, num_experts):
    import dist_moe

    sent = dist_moe.dispatch(x, expert_ids, weights, num_experts=num_experts)
    return dist_moe.expert_mlp(x, w1, w2, w3, sent.offsets, sent.row_slot, top_k=sent.top_k, weights=weights,
                               backend="triton")


def layer_reference(inputs, expert_ids, grad_out):
    """float64, one expert at a time."""
    import torch
    import torch.nn.functional as F

    x, w1, w2, w3, weights = (t.detach().double().requires_grad_() for t in inputs)
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    token = order // top_k
    routed = x[token]
    outs, start = [], 0
    for e, c in enumerate(counts):
        xe = routed[start:start + c]
        outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += c
    y = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(x).index_add_(0, token, y)
    grads = torch.autograd.grad(out, [x, w1, w2, w3, weights], grad_out.double())
    return [out.detach(), *grads]


def kernel_breakdown(step, rows: int = 14) -> list[str]:
    """GPU time per kernel name over one step (torch.profiler), the largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
        return table.splitlines()
    except Exception as err:  # the profiler is a diagnostic: never fail the run over it
        return [f"profiler unavailable: {type(err).__name__}: {err}"]


def section_layer(setup: Setup, budget_s: float) -> dict:
    import torch

    from dist_moe.kernels.configs import chosen_configs

    gen = torch.Generator(device=setup.device).manual_seed(2)
    cpu_gen = torch.Generator().manual_seed(3)  # routing draws
    e, dim, ffn, tokens, top_k = setup.experts, setup.hidden, setup.ffn, setup.tokens, setup.top_k
    params = [
        torch.randn(tokens, dim, generator=gen, device=setup.device),
        torch.randn(e, ffn, dim, generator=gen, device=setup.device) * dim**-0.5,
        torch.randn(e, dim, ffn, generator=gen, device=setup.device) * ffn**-0.5,
        torch.randn(e, ffn, dim, generator=gen, device=setup.device) * dim**-0.5,
    ]
    params = [p.to(setup.device, setup.dtype).requires_grad_() for p in params]
    weights = torch.rand(tokens, top_k, generator=gen, device=setup.device)
    weights = (weights / weights.sum(1, keepdim=True)).to(setup.device).requires_grad_()
    inputs = [*params, weights]
    grad_out = torch.randn(tokens, dim, generator=gen, device=setup.device).to(setup.dtype)
    routings = {}
    slots = (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None, :]) % e  # balanced, distinct per token
    routings["uniform"] = slots[torch.randperm(tokens, generator=cpu_gen)]
    zipf = torch.tensor([1.0 / (i + 1) for i in range(e)])
    routings["skewed"] = torch.multinomial(zipf.expand(tokens, e), top_k, replacement=False, generator=cpu_gen)
    gmm, how = baseline_grouped_mm(setup) if has_torch_grouped_mm() else (None, "unavailable")

    result = {"routings": {}, "baseline_backward": how}
    for routing, ids in routings.items():
        ids = ids.to(setup.device)
        loads = torch.bincount(ids.flatten(), minlength=e).tolist()
        entry = {"loads_min_max": [min(loads), max(loads)]}
        want = layer_reference(inputs, ids, grad_out)
        pipelines = {"dist_moe fused": lambda: fused_layer(*inputs, ids, e)}
        if gmm is not None:
            pipelines["usual (torch._grouped_mm)"] = lambda: usual_layer(*inputs, ids, e, gmm)
        for name, forward in pipelines.items():
            try:
                def step():
                    out = forward()
                    return [out, *torch.autograd.grad(out, inputs, grad_out)]

                got = step()  # the first call also tunes dist_moe's kernels
                errors = {k: rel_err(g, w) for k, g, w in zip(["out", "x", "w1", "w2", "w3", "weights"], got, want)}
                ok = all(v <= LAYER_RTOL for v in errors.values())
                del got
                fwd_ms = setup.time_ms(lambda: forward(), reps=5)
                step_ms = setup.time_ms(lambda: step(), reps=5)
                entry[name] = {"errors": errors, "ok": ok, "forward_ms": fwd_ms, "forward_backward_ms": step_ms}
                if routing == "uniform" and not setup.dry:
                    entry[name]["kernels"] = kernel_breakdown(step)
            except Exception as err:
                entry[name] = {"error": f"{type(err).__name__}: {err}"[:400], "trace": traceback.format_exc()[-2000:]}
            shown = {k: v for k, v in entry[name].items() if k != "kernels"}
            print(f"[layer] {routing} {name}: {shown}", flush=True)
            for line in entry[name].get("kernels", []):
                print(f"[layer]   {line}", flush=True)
        result["routings"][routing] = entry
    result["tuned"] = {str(k): v.name() for k, v in chosen_configs().items()}
    return result


# ----------------------------------------------------------------------------------------------
# Orchestration and the final table


def run_section(name: str, args) -> None:
    setup = Setup(args.dry_run)
    budget = args.budget_s
    t = time.time()
    fn = {"gemm": section_gemm, "layer": section_layer, "wgrad": section_wgrad}[name]
    result = {"env": env_info(), "seconds": None}
    try:
        result.update(fn(setup, budget))
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
    result["seconds"] = time.time() - t
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def best_of(sweep: list[dict], key: str):
    rows = [(r["results"][key]["tflops"], r["config"]) for r in sweep
            if key in r.get("results", {}) and "tflops" in r["results"][key]]
    return max(rows) if rows else (None, None)


def report(results: dict) -> list[str]:
    lines = []
    env = next((r["env"] for r in results.values() if isinstance(r, dict) and "env" in r), {})
    lines.append(f"machine: {env}")
    gemm = results.get("gemm", {})
    if "sweep" in gemm:
        lines.append("")
        lines.append("grouped GEMM forward, TFLOP/s (rows 32768, 32 experts; bf16)")
        lines.append(f"{'shape/routing':22s} {'triton best':>11s} {'grouped_mm':>10s} {'torch._gmm':>10s} "
                     f"{'loop':>7s} {'best/torch':>10s}  best config")
        for key, anchors in gemm.get("anchors", {}).items():
            best, config = best_of(gemm["sweep"], key)
            tuned = anchors.get("dist_moe.grouped_mm", {}).get("tflops")
            torch_gmm = anchors.get("torch._grouped_mm", {}).get("tflops")
            loop = anchors.get("per-expert loop", {}).get("tflops")
            ratio = best / torch_gmm if best and torch_gmm else None
            fmt = lambda v, w: f"{v:{w}.0f}" if v else f"{'-':>{w}s}"  # noqa: E731
            verdict = "" if ratio is None else ("  meets 0.95x" if ratio >= 0.95 else "  BELOW 0.95x")
            lines.append(f"{key:22s} {fmt(best, 11)} {fmt(tuned, 10)} {fmt(torch_gmm, 10)} {fmt(loop, 7)} "
                         f"{(f'{ratio:10.3f}' if ratio else '         -')}  {config}{verdict}")
        failed = [f"{r['config']}: {r['error']}" for r in gemm["sweep"] if "error" in r]
        wrong = [r["config"] for r in gemm["sweep"] if any(not v["ok"] for v in r.get("results", {}).values())]
        if failed:
            lines.append("configs that did not run: " + "; ".join(failed))
        if wrong:
            lines.append("configs with WRONG results: " + ", ".join(wrong))
        if gemm.get("budget_reached"):
            lines.append("(sweep stopped at its time budget)")
    elif "error" in gemm:
        lines.append(f"gemm section failed: {gemm['error'][-500:]}")
    layer = results.get("layer", {})
    if "routings" in layer:
        lines.append("")
        lines.append("MoE routed experts forward+backward, ms (4096 tokens x top-8, 32 experts, 7168/2048; bf16; "
                     f"usual pipeline backward: {layer.get('baseline_backward')})")
        lines.append(f"{'routing':10s} {'pipeline':28s} {'fwd':>8s} {'fwd+bwd':>9s} {'max rel err':>12s}")
        for routing, entry in layer["routings"].items():
            for name in ("usual (torch._grouped_mm)", "dist_moe fused"):
                v = entry.get(name)
                if v is None:
                    continue
                if "error" in v:
                    lines.append(f"{routing:10s} {name:28s} failed: {v['error'][:150]}")
                    continue
                lines.append(f"{routing:10s} {name:28s} {v['forward_ms']:8.2f} {v['forward_backward_ms']:9.2f} "
                             f"{max(v['errors'].values()):12.2e}{'' if v['ok'] else '  WRONG'}")
            usual, ours = entry.get("usual (torch._grouped_mm)", {}), entry.get("dist_moe fused", {})
            if "forward_backward_ms" in usual and "forward_backward_ms" in ours:
                speedup = usual["forward_backward_ms"] / ours["forward_backward_ms"]
                lines.append(f"{routing:10s} {'speed-up (usual / fused)':28s} "
                             f"{usual['forward_ms'] / ours['forward_ms']:8.2f} {speedup:9.2f}"
                             f"  {'meets 1.2x' if speedup >= 1.2 else 'BELOW 1.2x'}")
        for name, config in layer.get("tuned", {}).items():
            lines.append(f"  tuned {name}: {config}")
    elif "error" in layer:
        lines.append(f"layer section failed: {layer['error'][-500:]}")
    wgrad = results.get("wgrad", {})
    if "sweep" in wgrad:
        lines.append("")
        lines.append("weight-gradient GEMM out[e] = x_e^T dy_e, TFLOP/s")
        for key in sorted({k for r in wgrad["sweep"] for k in r.get("results", {})}):
            best, config = best_of(wgrad["sweep"], key)
            torch_gmm = wgrad.get("anchors", {}).get(key, {}).get("torch._grouped_mm", {}).get("tflops")
            ratio = f"{best / torch_gmm:.3f}" if best and torch_gmm else "-"
            lines.append(f"{key:22s} triton best {best or 0:6.0f}  torch._grouped_mm {torch_gmm or 0:6.0f}  "
                         f"ratio {ratio}  {config}")
    elif "error" in wgrad:
        lines.append(f"wgrad section failed: {wgrad['error'][-500:]}")
    return lines


def main() -> None:
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.section != "all":
        run_section(args.section, args)
        return
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    start = time.time()
    for name in SECTIONS:
        path = out_dir / f"moe_bench_{name}.json"
        path.unlink(missing_ok=True)
        left = args.budget_s - (time.time() - start)
        # gemm takes 60% of what the layer left, wgrad the rest; a sweep stops at its budget and the
        # timeout (budget plus compile slack) only catches hangs.
        budget = {"layer": LAYER_TIMEOUT_S, "gemm": max(60.0, 0.6 * left), "wgrad": max(40.0, left)}[name]
        timeout = LAYER_TIMEOUT_S if name == "layer" else budget + 90
        cmd = [sys.executable, __file__, "--section", name, "--json", str(path), "--budget-s", str(budget)]
        if args.dry_run:
            cmd.append("--dry-run")
        print(f"== section {name} (budget {budget:.0f}s)", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=timeout, env=dict(os.environ))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        results[name] = json.loads(path.read_text()) if path.exists() else {"error": f"section exited with {code}"}
    lines = report(results)
    print(f"\n== dist-moe benchmark ({time.time() - start:.0f}s)")
    print("\n".join(lines))
    if os.environ.get("OUT"):
        (out_dir / "moe_bench.json").write_text(json.dumps({"results": results, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
