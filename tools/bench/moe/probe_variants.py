"""Where the fused expert MLP's kernels lose time: each launch of the layer in several variants, timed alone.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/moe/probe_variants.py [--budget-s 240]

DeepSeek-V3 shapes (uniform routing, 32768 routed rows, bf16, H200). Forward gate/up: the shipped
in-kernel gather against the same dual-accumulator GEMM on a pre-gathered (padded, TMA) copy and
against one plain GEMM of half the width, with and without the gather (so the cost of the gather
and of the SwiGLU epilogue show separately). Backward: dh = dOut @ w2 in several configurations,
then the memory-bound swiglu_backward pass in several block shapes (GB/s of the bytes it must
move). Each variant's outputs are compared with the first one's (relative max difference).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--layer-only", action="store_true", help="only the layer step's host and profiler figures")
    p.add_argument("--forward-only", action="store_true", help="only the forward gate/up variants")
    args = p.parse_args()

    import torch
    from triton.testing import do_bench

    from bench_setup import ProbeLayer, rel_err
    from dist_moe.kernels.configs import RowConfig, row_candidates
    from dist_moe.kernels.launch import (
        EPILOGUE_SWIGLU,
        RowOperands,
        gather_rows,
        row_gemm,
        swiglu_backward,
    )

    t0 = time.time()
    layer = ProbeLayer.make()
    dev, dt = torch.device("cuda"), torch.bfloat16
    tokens, top_k, experts, dim, ffn, rows = (layer.tokens, layer.top_k, layer.experts, layer.dim, layer.ffn,
                                              layer.rows)
    x, w1, w3, w2, ids, weights = layer.x, layer.w1, layer.w3, layer.w2, layer.ids, layer.weights
    offsets, slot, flat_w, maps = layer.offsets, layer.slot, layer.flat_weights, layer.maps
    gpu = torch.device("cuda")

    def out_of_time() -> bool:
        return args.layer_only or time.time() - t0 > args.budget_s

    def report(name: str, ms: float, flops: float, diff: float | None = None) -> None:
        extra = f"  diff {diff:.1e}" if diff is not None else ""
        print(f"{name:70s} {ms:7.3f} ms {flops / ms / 1e9 if flops else 0:6.0f} TFLOP/s{extra}", flush=True)

    def bench(fn) -> float:
        return do_bench(fn, warmup=10, rep=50)

    # ---- forward gate/up
    gate_up_flops = 2.0 * rows * dim * ffn * 2
    acts = x.new_empty(rows, 3 * ffn)
    gate, up, h = acts[:, :ffn], acts[:, ffn:2 * ffn], acts[:, 2 * ffn:]
    ref = None
    dual = [*row_candidates("dual", gpu, dt),
            RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent=True, tma=True),
            RowConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=3, persistent=True,
                      tma=True),
            RowConfig(block_m=128, block_n=128, block_k=64, group_m=4, num_warps=8, num_stages=3, persistent=True,
                      tma=True),
            RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, persistent=True),
            RowConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=2, persistent=True, tma=True),
            RowConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=6, persistent=True, tma=True)]
    for config in dual:
        if out_of_time():
            break
        ops = RowOperands(a=x, b=w1.transpose(1, 2), b2=w3.transpose(1, 2), offsets=offsets, out=h, out2=gate,
                          out3=up, num_rows=rows, slot=slot, top_k=top_k, gather_a=True, epilogue=EPILOGUE_SWIGLU,
                          save_preact=True, maps=maps)
        try:
            row_gemm(ops, config)
            ref = acts.clone() if ref is None else ref
            report(f"fwd gate/up+SwiGLU gather  {config.name()}", bench(lambda: row_gemm(ops, config)),
                   gate_up_flops, rel_err(acts, ref))
        except Exception as err:
            print(f"fwd gate/up gather {config.name()}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    x_padded = gather_rows(x, slot, top_k, maps)
    if ref is None:  # forward variants skipped: stand-ins for the saved activations
        h.normal_()
        gate.normal_()
        up.normal_()
    report("gather_rows(x) -> padded copy", bench(lambda: gather_rows(x, slot, top_k, maps)), 0.0)
    for config in dual[:3]:  # the shipped candidates, with TMA for the (now un-gathered) A
        if out_of_time():
            break
        config = dataclasses.replace(config, tma=True)
        ops = RowOperands(a=x_padded, b=w1.transpose(1, 2), b2=w3.transpose(1, 2), offsets=offsets, out=h,
                          out2=gate, out3=up, num_rows=rows, padded_a=True, epilogue=EPILOGUE_SWIGLU,
                          save_preact=True, maps=maps)
        try:
            row_gemm(ops, config)
            report(f"fwd gate/up+SwiGLU pre-gathered TMA  {config.name()}", bench(lambda: row_gemm(ops, config)),
                   gate_up_flops, rel_err(acts, ref))
        except Exception as err:
            print(f"fwd gate/up padded {config.name()}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    half = x.new_empty(rows, ffn)
    for config in row_candidates("plain", gpu, dt)[:2]:
        for gathered in (True, False):
            if out_of_time():
                break
            ops = (RowOperands(a=x, b=w1.transpose(1, 2), offsets=offsets, out=half, num_rows=rows, slot=slot,
                               top_k=top_k, gather_a=True, maps=maps) if gathered else
                   RowOperands(a=x_padded, b=w1.transpose(1, 2), offsets=offsets, out=half, num_rows=rows,
                               padded_a=True, maps=maps))
            try:
                row_gemm(ops, config)
                report(f"fwd gate only, plain, {'gather' if gathered else 'padded TMA'}  {config.name()}",
                       bench(lambda: row_gemm(ops, config)), gate_up_flops / 2, rel_err(half, ref[:, :ffn]))
            except Exception as err:
                print(f"fwd gate only {config.name()}: {type(err).__name__}: {str(err)[:200]}", flush=True)

    if args.forward_only:
        return
    # ---- backward dOut @ w2, then the SwiGLU backward pass
    grad_out = torch.randn(tokens, dim, device=dev, dtype=dt)
    d_out = gather_rows(grad_out, slot, top_k, maps)
    grads = x.new_empty(maps.padded_rows, 3 * ffn)
    dgate, dup, hw = grads[:, :ffn], grads[:, ffn:2 * ffn], grads[:, 2 * ffn:]
    bwd_flops = 2.0 * rows * dim * ffn
    used = int(maps.padded_ends()[-1].item())
    dh = x.new_empty(rows, ffn)
    dweight = torch.empty(rows, device=dev, dtype=torch.float32)
    plain = [*row_candidates("plain", gpu, dt),
             RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent=True,
                       flatten=True, tma=True)]
    for config in plain:
        if out_of_time():
            break
        ops = RowOperands(a=d_out, b=w2, offsets=offsets, out=dh, num_rows=rows, padded_a=True, maps=maps)
        row_gemm(ops, config)
        report(f"bwd dh = dOut@w2 plain  {config.name()}", bench(lambda: row_gemm(ops, config)), bwd_flops)
    reference = None
    for block_c, warps in ((64, 8), (64, 4), (128, 8), (32, 4)):
        if out_of_time():
            break
        grads.fill_(float("nan"))

        def run(block_c=block_c, warps=warps):
            swiglu_backward(dh, (gate, up, h), (dgate, dup, hw), slot, maps, flat_w, dweight,
                            block_c=block_c, num_warps=warps)
        run()
        if reference is None:
            reference = (grads[:used].clone(), dweight.clone())
        diff = max(rel_err(grads[:used], reference[0]), rel_err(dweight, reference[1]))
        ms = bench(run)
        moved = (4 * rows + 3 * used) * ffn * 2
        print(f"{'bwd swiglu_backward pass  block_c %d warps %d' % (block_c, warps):70s} {ms:7.3f} ms "
              f"{moved / ms / 1e6:6.0f} GB/s  diff {diff:.1e}", flush=True)

    # ---- the layer step under the profiler: GPU busy time against wall time, the kernels by time
    from torch.profiler import ProfilerActivity, profile

    from layer_sections import fused_layer
    params = [t.clone().requires_grad_() for t in (x, w1, w2, w3)] + [weights.clone().requires_grad_()]

    def step():
        out = fused_layer(*params, ids, experts)
        return torch.autograd.grad(out, params, grad_out)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # Host time of a step with the GPU held back (so no launch waits for the GPU): if it is near
    # the GPU time, the step is host-bound and the GPU idles between kernels.
    torch.cuda._sleep(400_000_000)
    start = time.perf_counter()
    for _ in range(3):
        step()
    host_ms = (time.perf_counter() - start) * 1e3 / 3
    torch.cuda.synchronize()
    print(f"layer step: host {host_ms:.2f} ms per step with the GPU held back", flush=True)
    import dist_moe.kernels.launch as launch_module
    host_of = {}
    saved = {name: getattr(launch_module, name)
             for name in ("row_gemm", "weight_gemm", "gather_rows", "swiglu_backward", "TileMaps")}
    for name, original in saved.items():
        def timed(*a, _original=original, _name=name, **k):
            t = time.perf_counter()
            result = _original(*a, **k)
            host_of.setdefault(_name, []).append((time.perf_counter() - t) * 1e6)
            return result
        setattr(launch_module, name, timed)
    torch.cuda._sleep(400_000_000)
    step()
    torch.cuda.synchronize()
    print("host us per call: " + ", ".join(f"{n} {[round(v) for v in vals]}" for n, vals in host_of.items()),
          flush=True)
    for name, fn in saved.items():
        setattr(launch_module, name, fn)
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 / steps
    first = min(e.time_range.start for e in kernels)
    last = max(e.time_range.end for e in kernels)
    print(f"layer step: wall {wall_ms:.2f} ms, GPU span {(last - first) / 1e3 / steps:.2f} ms, "
          f"kernel time {busy_ms:.2f} ms per step", flush=True)
    kernels.sort(key=lambda e: e.time_range.start)
    gaps = [(b.time_range.start - a.time_range.end, a.name[:40], b.name[:40])
            for a, b in zip(kernels, kernels[1:])]
    print(f"gaps between kernels: {sum(g for g, _, _ in gaps) / 1e3 / steps:.2f} ms per step; the largest:",
          flush=True)
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {gap:8.1f} us  after {before:40s} before {after}", flush=True)
    for line in prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                          max_name_column_width=60).splitlines():
        print("  " + line, flush=True)
    print(f"probe done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
