"""Benchmark sections on the routed-experts layer (4096 tokens x top-8, 32 experts, 7168/2048, bf16),
forward + backward, outputs and all gradients checked against a float64 per-expert reference:

  layer      the usual pipeline (argsort permute, index gather, three torch._grouped_mm, SwiGLU,
             weighting, index_add_ scatter-add; backward by autograd) against dist_moe's fused path
             (dispatch + expert_mlp) with its own weight-gradient kernel, with the routed rows
             copied once and kept for the backward (keep_routed_input) and with the
             torch._grouped_mm fallback for the weight gradients; the pipelines timed one after
             the other and then interleaved (blocks of 3 and of 20 steps taking turns, medians:
             the ratio is taken from the 20-step blocks, so clock drift between pipelines does
             not decide it and the clocks are those of sustained work), then back to back (20-step
             blocks taking turns with no pause: steady state); torch.compile of the usual pipeline
             is an anchor too; the time of each dist-moe launch.
  bwd_sweep  the fused layer again with one kernel role's configuration forced at a time (the other
             roles tuned as shipped): every variant checked against float64, its launch timed in
             place, so the backward kernels are compared where they run.
"""
from __future__ import annotations

import time
import traceback

from bench_setup import LAYER_RTOL, LaunchTimer, Setup, has_torch_grouped_mm, rel_err

USUAL = "usual (torch._grouped_mm)"
USUAL_COMPILED = "usual, torch.compile"
FUSED = "dist_moe fused"
FUSED_TORCH_WGRAD = "dist_moe fused, torch wgrad"
# keep_routed_input: the routed rows copied once, read through TMA, kept for the backward (the
# usual pipeline's activation memory: it keeps its gathered rows for the grouped GEMMs' backward)
FUSED_KEEP = "dist_moe fused, routed x kept"
GRADS = ["out", "x", "w1", "w2", "w3", "weights"]
# (steps per block, rounds) of the interleaved timing. The H200 is power-limited (700 W) on this
# layer: after a 25 ms pause a 3-step block runs at higher clocks than sustained work (ratio 1.31
# there, 1.23 in 20-step blocks, 1.15-1.22 back to back), so the verdict uses the 20-step blocks.
INTERLEAVED_BLOCKS = ((3, 6), (20, 3))
VERDICT_BLOCK = 20
BACK_TO_BACK = (20, 3)  # (steps per block, rounds) with no pause between blocks: steady state


def baseline_grouped_mm(setup: Setup):
    """torch._grouped_mm with torch's own autograd when it has one (what training code relies
    on), else with an explicit backward through torch._grouped_mm. Returns (function, description)."""
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

    class Explicit(torch.autograd.Function):
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
            except RuntimeError:  # a build that wants a compact transposed operand
                dw = torch._grouped_mm(x.t().contiguous(), grad, offs=offsets)
            return dx, dw, None

    return Explicit.apply, "explicit backward through torch._grouped_mm"


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


def compiled_usual_layer(setup: Setup, gmm):
    """torch.compile of the usual pipeline (inductor, static shapes), the strongest torch anchor. On
    --dry-run: the aot_eager backend with the grouped GEMM left out of the graph (a check of the path:
    inductor's CPU build takes minutes, and torch._grouped_mm's meta function wants bf16)."""
    import torch

    compiled = torch.compile(usual_layer, dynamic=False, backend="aot_eager" if setup.dry else "inductor")
    traced_gmm = torch.compiler.disable(gmm) if setup.dry else gmm
    return lambda x, w1, w2, w3, weights, expert_ids, num_experts: compiled(
        x, w1, w2, w3, weights, expert_ids, num_experts, traced_gmm)


def fused_layer(x, w1, w2, w3, weights, expert_ids, num_experts, weight_grad="triton", keep_routed_input=False):
    import dist_moe

    sent = dist_moe.dispatch(x, expert_ids, weights, num_experts=num_experts)
    return dist_moe.expert_mlp(x, w1, w2, w3, sent.offsets, sent.row_slot, top_k=sent.top_k, weights=weights,
                               backend="triton", weight_grad=weight_grad, keep_routed_input=keep_routed_input)


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


def kernel_breakdown(step, rows: int = 10) -> list[str]:
    """GPU time per kernel name over one step (torch.profiler), the largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=50)
        return table.splitlines()
    except Exception as err:  # the profiler is a diagnostic: never fail the run over it
        return [f"profiler unavailable: {type(err).__name__}: {err}"]


class LayerCase:
    """Inputs, routings and float64 references of the layer benchmark."""

    def __init__(self, setup: Setup):
        import torch

        self.setup = setup
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
        weights = (weights / weights.sum(1, keepdim=True)).requires_grad_()
        self.inputs = [*params, weights]
        self.grad_out = torch.randn(tokens, dim, generator=gen, device=setup.device).to(setup.dtype)
        slots = (torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)[None, :]) % e  # balanced, distinct
        zipf = torch.tensor([1.0 / (i + 1) for i in range(e)])
        self.routings = {
            "uniform": slots[torch.randperm(tokens, generator=cpu_gen)].to(setup.device),
            "skewed": torch.multinomial(zipf.expand(tokens, e), top_k, replacement=False,
                                        generator=cpu_gen).to(setup.device),
        }
        self._references = {}

    def reference(self, routing: str):
        if routing not in self._references:
            self._references[routing] = layer_reference(self.inputs, self.routings[routing], self.grad_out)
        return self._references[routing]

    def step_of(self, forward):
        import torch

        def step():
            out = forward()
            return [out, *torch.autograd.grad(out, self.inputs, self.grad_out)]
        return step

    def errors(self, step, routing: str) -> dict:
        got = step()
        return {k: rel_err(g, w) for k, g, w in zip(GRADS, got, self.reference(routing))}

    def launches(self, step) -> list[dict]:
        """Each dist-moe launch of one step, timed (after the tuner has chosen)."""
        import torch

        timer = LaunchTimer(self.setup)
        if self.setup.device.type == "cuda":
            # Hold the GPU back (~25 ms) so the host has queued the whole step before the first
            # launch runs: otherwise the first launches' times include their host-side launch cost.
            torch.cuda._sleep(50_000_000)
        with timer.active():
            step()
        return timer.results()


def section_layer(setup: Setup, budget_s: float) -> dict:
    from dist_moe.kernels.configs import chosen_configs

    case = LayerCase(setup)
    e = setup.experts
    gmm, how = baseline_grouped_mm(setup) if has_torch_grouped_mm() else (None, "unavailable")
    result = {"routings": {}, "baseline_backward": how}
    for routing, ids in case.routings.items():
        import torch

        loads = torch.bincount(ids.flatten(), minlength=e).tolist()
        entry = {"loads_min_max": [min(loads), max(loads)]}
        pipelines = {FUSED: lambda: fused_layer(*case.inputs, ids, e),
                     FUSED_KEEP: lambda: fused_layer(*case.inputs, ids, e, keep_routed_input=True)}
        if gmm is not None:
            pipelines[USUAL] = lambda: usual_layer(*case.inputs, ids, e, gmm)
            compiled = compiled_usual_layer(setup, gmm)
            pipelines[USUAL_COMPILED] = lambda: compiled(*case.inputs, ids, e)
            pipelines[FUSED_TORCH_WGRAD] = lambda: fused_layer(*case.inputs, ids, e, "torch_grouped_mm")
        for name, forward in pipelines.items():
            try:
                step = case.step_of(forward)
                errors = case.errors(step, routing)  # the first call also tunes dist_moe's kernels
                entry[name] = {"errors": errors, "ok": all(v <= LAYER_RTOL for v in errors.values()),
                               "forward_ms": setup.time_ms(forward, reps=10),
                               "forward_backward_ms": setup.time_ms(step, reps=10),
                               "peak_mib": setup.peak_mib(step)}
                if name != USUAL:
                    entry[name]["launches"] = case.launches(step)
                elif routing == "uniform" and not setup.dry:
                    entry[name]["kernels"] = kernel_breakdown(step)
            except Exception as err:
                entry[name] = {"error": f"{type(err).__name__}: {err}"[:400], "trace": traceback.format_exc()[-2000:]}
            shown = {k: v for k, v in entry[name].items() if k not in ("kernels", "launches", "trace")}
            print(f"[layer] {routing} {name}: {shown}", flush=True)
            for line in entry[name].get("kernels", []):
                print(f"[layer]   {line}", flush=True)
            for launch in entry[name].get("launches", []):
                print(f"[layer]   {_launch_line(launch)}", flush=True)
        steps = {name: case.step_of(pipelines[name]) for name in pipelines if entry[name].get("ok")}
        if len(steps) > 1:  # the comparison itself: pipelines taking turns, medians per block length
            for per_block, rounds in INTERLEAVED_BLOCKS:
                for name, ms in setup.interleaved_ms(steps, rounds=rounds, per_block=per_block).items():
                    entry[name].setdefault("interleaved_ms", {})[per_block] = ms
            print(f"[layer] {routing} interleaved fwd+bwd medians (ms by block length): "
                  + ", ".join(f"{n} {entry[n]['interleaved_ms']}" for n in steps), flush=True)
            per_block, rounds = BACK_TO_BACK
            for name, ms in setup.back_to_back_ms(steps, rounds=rounds, per_block=per_block).items():
                entry[name]["back_to_back_ms"] = ms
            print(f"[layer] {routing} back-to-back fwd+bwd medians ({per_block}-step blocks, no pauses): "
                  + ", ".join(f"{n} {entry[n]['back_to_back_ms']:.3f}" for n in steps), flush=True)
        result["routings"][routing] = entry
    result["tuned"] = {str(k): v.name() for k, v in chosen_configs().items()}
    return result


def _launch_line(launch: dict) -> str:
    ms = f"{launch['ms']:7.3f} ms" if launch["ms"] is not None else "      - ms"
    tflops = f"{launch['tflops']:5.0f} TFLOP/s" if launch["tflops"] else " " * 13
    return f"{launch['name']:34s} {ms} {tflops}  {launch['config']}"


# How LaunchTimer names the launches of each role.
ROLE_LAUNCHES = {"plain": ("dh = dOut @ w2", "down"), "concat": ("dx =",), "dual": ("gate/up",),
                 "weight": ("weight grad",)}


def bwd_variants(dry: bool) -> list[tuple[str, object]]:
    """(role, configuration) pairs the in-place sweep forces: the shipped candidates of the
    backward roles, the forward gate/up role and the padded weight gradient, plus variants."""
    import torch

    from dist_moe.kernels.configs import ROLES, RowConfig, WeightConfig, row_candidates, weight_candidates
    from gemm_sections import _as_hopper

    if dry:
        return [("concat", RowConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1,
                                     persistent=True, tma=True)),
                ("weight", WeightConfig(block_k=32, block_n=16, block_r=16, group_k=1, num_warps=4, num_stages=1,
                                        persistent=True))]
    gpu = torch.device("cuda")
    shipped = {role: _as_hopper(lambda role=role: row_candidates(role, gpu, torch.bfloat16)) for role in ROLES}
    extra = {
        "plain": [RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent=True,
                            flatten=True, tma=True)],
        "concat": [],  # the shipped three cover the variants worth timing
        "dual": [RowConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)],
    }
    variants = []
    for role in ("plain", "concat", "dual"):
        variants += [(role, c) for c in shipped[role] + extra[role]]
    weights = _as_hopper(lambda: weight_candidates(gpu, torch.bfloat16, tma=True))
    variants += [("weight", c) for c in weights]
    return variants


def section_bwd_sweep(setup: Setup, budget_s: float) -> dict:
    import dist_moe.kernels.launch as launch
    from dist_moe.kernels import configs

    t0 = time.time()
    case = LayerCase(setup)
    e = setup.experts
    routings = ["uniform", "skewed"]
    result = {"variants": [], "budget_reached": False}
    steps = {r: case.step_of(lambda r=r: fused_layer(*case.inputs, case.routings[r], e)) for r in routings}
    for routing in routings:  # tune the shipped choice of every role once, and the references
        case.errors(steps[routing], routing)
    print(f"[bwd_sweep] references and tuning ready ({time.time() - t0:.0f}s)", flush=True)
    row_candidates, weight_candidates = launch.row_candidates, launch.weight_candidates
    for role, config in bwd_variants(setup.dry):
        if time.time() - t0 > budget_s:
            result["budget_reached"] = True
            print(f"[bwd_sweep] time budget reached; {role} {config.name()} and later skipped", flush=True)
            break
        if role == "weight":
            launch.weight_candidates = lambda device, dtype=None, *, tma=False, c=config: (
                [c] if tma else weight_candidates(device, dtype, tma=tma))
            stale = [k for k in configs._chosen if k[0] == "weight" and k[1]]
        else:
            launch.row_candidates = lambda r, device, dtype=None, c=config, role=role: (
                [c] if r == role else row_candidates(r, device, dtype))
            stale = [k for k in configs._chosen if k[0] == "row" and k[1] == role]
        for key in stale:
            del configs._chosen[key]
        row = {"role": role, "config": config.name(), "results": {}}
        try:
            for routing in routings:
                errors = case.errors(steps[routing], routing)
                ok = all(v <= 3e-2 for v in errors.values())
                entry = {"ok": ok, "max_err": max(errors.values())}
                if ok:
                    entry["forward_backward_ms"] = setup.time_ms(steps[routing], reps=5)
                    mine = [x for x in case.launches(steps[routing])
                            if x["config"] == config.name() and x["name"].startswith(ROLE_LAUNCHES[role])]
                    entry["launch_ms"] = sum(x["ms"] for x in mine if x["ms"] is not None) if mine else None
                    flops = [x for x in mine if x["tflops"]]
                    entry["launch_tflops"] = ([round(x["tflops"]) for x in flops] if flops else None)
                row["results"][routing] = entry
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        finally:
            launch.row_candidates, launch.weight_candidates = row_candidates, weight_candidates
            for key in [k for k in configs._chosen if (k[0] == "weight" and k[1]) or (k[0] == "row" and k[1] == role)]:
                del configs._chosen[key]  # back to the tuner's own choice for the next variant
        result["variants"].append(row)
        summary = row.get("error") or "  ".join(
            f"{r} {v['forward_backward_ms']:.2f} ms (launch {v['launch_ms'] or 0:.2f} ms {v['launch_tflops']})"
            if v["ok"] else f"{r} WRONG(err {v['max_err']:.1e})" for r, v in row["results"].items())
        print(f"[bwd_sweep] {role:10s} {config.name():40s} {summary}", flush=True)
    return result
