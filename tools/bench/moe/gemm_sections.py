"""Benchmark sections on single kernels: the grouped GEMM forward (dist_moe.grouped_mm as shipped,
torch._grouped_mm, a per-expert loop, and a short sweep of tile configurations) and the weight-
gradient kernel on the layer's padded operands (a sweep against torch._grouped_mm). Every measured
result is checked against float64 first; what is compared on one case takes turns being timed."""
from __future__ import annotations

import time

from bench_setup import BF16_RTOL, Setup, has_torch_grouped_mm, rel_err

GEMM_ROUNDS, GEMM_BLOCK = 7, 10  # the forward comparison: rounds of turns, calls per block


def row_sweep(dry: bool):
    """The shipped grouped-GEMM candidates and the run-1 runners-up, for comparison in one run."""
    from dist_moe.kernels.configs import RowConfig, row_candidates

    if dry:
        return [RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1),
                RowConfig(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1, persistent=True,
                          flatten=True, tma=True)]
    import torch

    shipped = _as_hopper(lambda: row_candidates("plain", torch.device("cuda"), torch.bfloat16))
    return shipped + [
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tma=True),
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, persistent=True, tma=True),
        RowConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),  # pointer loads
    ]


def weight_sweep(dry: bool):
    """(padded TMA configs, pointer configs) of the weight-gradient kernel: the shipped candidates
    first, then variants (tile shape, rows per step, L2 grouping, programs per SM)."""
    from dist_moe.kernels.configs import WeightConfig, weight_candidates

    if dry:
        tiny = [WeightConfig(block_k=16, block_n=16, block_r=16, group_k=2, num_warps=4, num_stages=1),
                WeightConfig(block_k=32, block_n=16, block_r=32, group_k=1, num_warps=4, num_stages=1,
                             persistent=True)]
        return tiny, tiny[:1]
    import torch

    tma = _as_hopper(lambda: weight_candidates(torch.device("cuda"), torch.bfloat16, tma=True))
    tma += [
        WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3, persistent=True),
        WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=4, num_stages=3, persistent=True, per_sm=2),
        WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3, persistent=True, group_k=1),
        WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3, persistent=True, group_k=32),
        WeightConfig(block_k=256, block_n=128, block_r=64, num_warps=8, num_stages=3, persistent=True),
        WeightConfig(block_k=256, block_n=128, block_r=64, num_warps=8, num_stages=3, persistent=True,
                     store_tma=True),
        WeightConfig(block_k=128, block_n=256, block_r=64, num_warps=8, num_stages=3, store_tma=True),
        WeightConfig(block_k=128, block_n=256, block_r=32, num_warps=8, num_stages=4, persistent=True),
        WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=8, num_stages=4, persistent=True),
        WeightConfig(block_k=128, block_n=128, block_r=32, num_warps=4, num_stages=4, persistent=True, per_sm=2),
        # Shorter row steps, deeper prefetch across the tile boundary, hoping more chunks in flight hide the
        # store: 11-18% slower than the shipped 128x256x64 on an H100 (2026-12-07), kept to show it:
        WeightConfig(block_k=128, block_n=256, block_r=32, group_k=32, num_warps=8, num_stages=5, persistent=True,
                     store_tma=True),
        WeightConfig(block_k=128, block_n=256, block_r=32, group_k=32, num_warps=8, num_stages=6, persistent=True,
                     store_tma=True),
        WeightConfig(block_k=256, block_n=128, block_r=32, group_k=32, num_warps=8, num_stages=6, persistent=True,
                     store_tma=True),
        # The warp-specialized nested loop (weight_gemm_specialized.py) in 128x128 tiles: 4-warp groups, the
        # store overlapped (its 128x256x64 form is the third shipped candidate, already above).
        *(WeightConfig(block_k=128, block_n=128, block_r=64, num_warps=4, num_stages=stages, persistent=True,
                       store_tma=True, warp_specialize=True) for stages in (3, 4)),
    ]
    pointer = _as_hopper(lambda: weight_candidates(torch.device("cuda"), torch.bfloat16, tma=False))
    return tma, pointer


def _record_sweep(result: dict, rows: dict, tag: str, width: int) -> None:
    """Append the sweep's rows to the result and print one line per configuration."""
    for row in rows.values():
        result["sweep"].append(row)
        summary = row.get("error") or "  ".join(
            (f"{key} {v['tflops']:.0f}" if "tflops" in v else f"{key} -") if v["ok"]
            else f"{key} WRONG(err {v['err']:.1e})" for key, v in row["results"].items())
        print(f"[{tag}] {row['config']:{width}s} {summary}", flush=True)


def _as_hopper(make):
    """Candidates as an sm_90 GPU sees them (also when called on a CPU by check_hopper_compile)."""
    from dist_moe.kernels.hopper_check import _capability

    with _capability(9, 0):
        return make()


def section_gemm(setup: Setup, budget_s: float) -> dict:
    import torch

    import dist_moe
    from dist_moe.kernels.configs import chosen_configs
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
            cases[f"{shape}/{routing}"] = dict(x=x, w=linear_w.transpose(1, 2), counts=counts,
                                               offsets=setup.offsets(counts), want=want, flops=2.0 * setup.rows * k * n)
    print(f"[gemm] references ready ({time.time() - t0:.0f}s)", flush=True)

    result = {"anchors": {}, "sweep": [], "budget_reached": False}
    # dist_moe.grouped_mm as shipped first: its first call per shape tunes over the shipped candidates.
    for key, c in cases.items():
        def shipped(c=c):
            return dist_moe.grouped_mm(c["x"], c["w"], c["offsets"], backend="triton")

        def torch_gmm(c=c):
            return torch._grouped_mm(c["x"], c["w"], offs=c["offsets"])

        bounds = [0]
        for count in c["counts"]:
            bounds.append(bounds[-1] + count)

        def loop(c=c, bounds=bounds):
            out = torch.empty(setup.rows, c["w"].shape[2], device=setup.device, dtype=setup.dtype)
            for e in range(setup.experts):
                torch.mm(c["x"][bounds[e]:bounds[e + 1]], c["w"][e], out=out[bounds[e]:bounds[e + 1]])
            return out

        anchors, timed = {}, {}
        runners = {"dist_moe.grouped_mm": shipped, "per-expert loop": loop}
        if has_torch_grouped_mm():
            runners["torch._grouped_mm"] = torch_gmm
        for name, fn in runners.items():
            try:
                out = fn()  # dist_moe's first call per shape tunes over the shipped candidates
                entry = {"err": rel_err(out, c["want"])}
                del out
                entry["ok"] = entry["err"] <= BF16_RTOL
                if name != "per-expert loop":
                    entry["host_us"] = setup.host_us(fn)
                    graph = setup.graph_ms(fn)
                    entry["graph_tflops"] = c["flops"] / graph / 1e9 if graph else None
                anchors[name], timed[name] = entry, fn
            except Exception as err:
                anchors[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        # The runners take turns (blocks of 10 calls, 7 rounds, medians): clock drift on this
        # power-limited GPU then falls on all of them alike.
        for name, ms in setup.interleaved_ms(timed, rounds=GEMM_ROUNDS, per_block=GEMM_BLOCK).items():
            anchors[name].update(ms=ms, tflops=c["flops"] / ms / 1e9)
        result["anchors"][key] = anchors
        print(f"[gemm] {key}: " + "  ".join(
            f"{n} {v['tflops']:.0f}{'' if v['ok'] else ' WRONG'}" if "tflops" in v else f"{n} {v['error']}"
            for n, v in anchors.items()), flush=True)
    result["tuned"] = {str(k): v.name() for k, v in chosen_configs().items()}

    # The sweep: per case every configuration is checked, then they take turns being timed.
    configs = row_sweep(setup.dry)
    rows = {config.name(): {"config": config.name(), "results": {}} for config in configs}
    for key, c in cases.items():
        if time.time() - t0 > budget_s:
            result["budget_reached"] = True
            print(f"[gemm] time budget reached; the sweep of {key} and later cases skipped", flush=True)
            break
        fns = {}
        for config in configs:
            row = rows[config.name()]
            try:
                out = torch.empty_like(c["want"], dtype=setup.dtype)
                ops = RowOperands(a=c["x"], b=c["w"], offsets=c["offsets"], out=out, num_rows=setup.rows)
                row_gemm(ops, config)
                err = rel_err(out, c["want"])
                row["results"][key] = {"err": err, "ok": err <= BF16_RTOL}
                if err <= BF16_RTOL:
                    fns[config.name()] = lambda ops=ops, config=config: row_gemm(ops, config)
            except Exception as err:  # compile failure, shared memory, descriptor limits: record and go on
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        for name, ms in setup.interleaved_ms(fns, rounds=GEMM_ROUNDS, per_block=GEMM_BLOCK).items():
            rows[name]["results"][key].update(ms=ms, tflops=c["flops"] / ms / 1e9)
    _record_sweep(result, rows, "gemm", 42)
    return result


def section_wgrad(setup: Setup, budget_s: float) -> dict:
    """The weight-gradient kernel on the layer's two shapes: w2 (P = dOut rows [*, 7168], Q = w*h
    [*, 2048]) and w1+w3 (P = [dgate | dup] [*, 4096] in a 6144-wide buffer, Q = x rows [*, 7168],
    two outputs), operands in the padded layout (TMA) or not (pointer loads, masked tails)."""
    import torch

    from dist_moe.kernels.launch import TileMaps, gather_rows, weight_gemm

    t0 = time.time()
    gen = torch.Generator(device=setup.device).manual_seed(1)
    d, f, e = setup.hidden, setup.ffn, setup.experts
    sources = {
        "w2": (torch.randn(setup.rows, d, generator=gen, device=setup.device).to(setup.dtype),
               torch.randn(setup.rows, f, generator=gen, device=setup.device).to(setup.dtype), [d]),
        "w13": (torch.randn(setup.rows, 3 * f, generator=gen, device=setup.device).to(setup.dtype)[:, :2 * f],
                torch.randn(setup.rows, d, generator=gen, device=setup.device).to(setup.dtype), [f, f]),
    }
    cases = {}
    identity = torch.arange(setup.rows, device=setup.device, dtype=torch.int32)
    for routing in ("uniform", "skewed"):
        counts = setup.counts(routing)
        offsets = setup.offsets(counts)
        maps = TileMaps(offsets, setup.rows)
        for shape, (p, q, widths) in sources.items():
            want, start = torch.empty(e, p.shape[1], q.shape[1], dtype=torch.float64, device=setup.device), 0
            for i, c in enumerate(counts):
                want[i] = p[start:start + c].double().T @ q[start:start + c].double()
                start += c
            p_padded = gather_rows(p, identity, 1, maps)
            if shape == "w13":  # the layer's P is a column block of a wider buffer
                wide = torch.zeros(p_padded.shape[0], 3 * f, device=setup.device, dtype=setup.dtype)
                wide[:, :2 * f] = p_padded
                p_padded = wide[:, :2 * f]
            cases[f"{shape}/{routing}"] = dict(
                p=p, q=q, p_padded=p_padded, q_padded=gather_rows(q, identity, 1, maps), offsets=offsets,
                padded_ends=maps.padded_ends(), widths=widths, want=want, flops=2.0 * setup.rows * p.shape[1] * q.shape[1])
    print(f"[wgrad] references ready ({time.time() - t0:.0f}s)", flush=True)

    def outs_for(c):
        return tuple(torch.empty(e, w, c["q"].shape[1], device=setup.device, dtype=setup.dtype) for w in c["widths"])

    result = {"sweep": [], "anchors": {}, "budget_reached": False}
    tma_configs, pointer_configs = weight_sweep(setup.dry)
    variants = [("padded tma", c) for c in tma_configs] + [("pointer", c) for c in pointer_configs]
    rows = {f"{how} {config.name()}": {"config": f"{how} {config.name()}", "results": {}} for how, config in variants}
    # Per case: the anchors and every variant are checked, then all of them take turns being timed
    # (blocks of 10 calls, 7 rounds, medians), so clock drift falls on all alike.
    for key, c in cases.items():
        if time.time() - t0 > budget_s:
            result["budget_reached"] = True
            print(f"[wgrad] time budget reached; {key} and later cases skipped", flush=True)
            break
        anchors, fns, flops = {}, {}, c["flops"]
        if has_torch_grouped_mm():
            for name, (p, q, offs) in {"torch._grouped_mm padded": (c["p_padded"], c["q_padded"], c["padded_ends"]),
                                       "torch._grouped_mm": (c["p"], c["q"], c["offsets"])}.items():
                def run(p=p, q=q, offs=offs, c=c):
                    outs, start = [], 0
                    for w in c["widths"]:  # one call per output, as dist-moe's fallback does
                        outs.append(torch._grouped_mm(p[:, start:start + w].t(), q, offs=offs))
                        start += w
                    return torch.cat(outs, dim=1)
                try:
                    err = rel_err(run(), c["want"])
                    anchors[name] = {"err": err, "ok": err <= BF16_RTOL}
                    fns[("anchor", name)] = run
                except Exception as err:
                    anchors[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        for how, config in variants:
            row = rows[f"{how} {config.name()}"]
            try:
                outs = outs_for(c)
                if how == "padded tma":
                    kwargs = dict(p=c["p_padded"], q=c["q_padded"], ends=c["padded_ends"], outs=outs, padded=True)
                else:
                    kwargs = dict(p=c["p"], q=c["q"], ends=c["offsets"], outs=outs)
                weight_gemm(**kwargs, config=config)
                err = rel_err(torch.cat(outs, dim=1), c["want"])
                row["results"][key] = {"err": err, "ok": err <= BF16_RTOL}
                if err <= BF16_RTOL:
                    fns[("variant", row["config"])] = lambda kwargs=kwargs, config=config: weight_gemm(**kwargs,
                                                                                                      config=config)
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        for (kind, name), ms in setup.interleaved_ms(fns, rounds=GEMM_ROUNDS, per_block=GEMM_BLOCK).items():
            target = anchors[name] if kind == "anchor" else rows[name]["results"][key]
            target.update(ms=ms, tflops=flops / ms / 1e9)
        result["anchors"][key] = anchors
        print(f"[wgrad] anchors {key}: " + "  ".join(
            f"{n} {v['tflops']:.0f}" if "tflops" in v else f"{n} {v.get('error', '-')[:80]}"
            for n, v in anchors.items()), flush=True)
    _record_sweep(result, rows, "wgrad", 48)
    return result
