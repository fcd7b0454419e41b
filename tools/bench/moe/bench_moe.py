"""dist-moe on one GPU at DeepSeek-V3 expert shapes: grouped GEMM and MoE layer, with anchors.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/moe/bench_moe.py [--tests]

Shapes: hidden 7168, expert width 2048, 32 local experts, 32768 routed rows (4096 tokens x top-8),
routing uniform (1024 rows per expert) or skewed (Zipf over the experts), bf16.

Sections, each in its own subprocess (a kernel that faults cannot take the others down; the
Triton cache on disk is shared), in this order, each within its share of the time budget:
  tests      (--tests) the GPU tests: pytest packages/dist-moe/tests -k gpu
  layer      routed experts forward+backward: the usual pipeline against dist_moe's fused path
             (own weight-gradient kernel, and the torch._grouped_mm weight-gradient fallback);
             the time of every dist-moe launch of a step (layer_sections.py)
  gemm       grouped GEMM forward: dist_moe.grouped_mm as shipped (first-call tuning over the
             shipped candidates), torch._grouped_mm, a per-expert loop; then a short sweep
  bwd_sweep  the fused layer with one kernel role's configuration forced at a time: backward
             kernels (and the forward gate/up) compared in place, each checked against float64
  wgrad      the weight-gradient kernel alone on the layer's operands, against torch._grouped_mm
Everything is checked against float64 before it is timed; what a section compares takes turns
being timed (blocks after a short pause of the GPU, medians over rounds), since the H200 is
power-limited and its clocks drift with how long it has been busy. Prints progress and a final table;
writes the results as JSON to $OUT/moe_bench.json when OUT is set. --dry-run runs the same code
on CPU through TRITON_INTERPRET=1 with tiny float32 shapes (a check of the script, not a measurement).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_setup import Setup, env_info  # noqa: E402

SECTIONS = ("tests", "layer", "gemm", "bwd_sweep", "wgrad")
# Budget shares (seconds) when the whole run has the default 400 s; scaled with --budget-s. A
# section's sweep stops at its budget; its subprocess is killed at budget + slack (hangs only).
SHARES = {"tests": 100, "layer": 150, "gemm": 50, "bwd_sweep": 60, "wgrad": 40}  # layer: compiling the anchor
SLACK_S = 45
HARD_LIMIT_S = 420.0  # the whole run ends within 7 minutes, whatever a section does
REPO = Path(__file__).resolve().parents[3]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=SECTIONS, default=None, help="run one section only")
    p.add_argument("--tests", action="store_true", help="also run the GPU tests first (pytest -k gpu)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="time budget in seconds: of the whole run, or of --section (default 400)")
    p.add_argument("--json", type=Path, default=None, help="where a section writes its results (internal)")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes: checks the script")
    return p.parse_args()


def section_tests(setup: Setup, budget_s: float) -> dict:
    """The GPU tests (first candidate of each kernel; one test runs every candidate)."""
    env = dict(os.environ, DIST_MOE_AUTOTUNE="0")
    cmd = [sys.executable, "-m", "pytest", str(REPO / "packages/dist-moe/tests"), "-k", "gpu", "-q",
           "-p", "no:cacheprovider", "--durations=5"]
    if setup.dry:
        cmd[cmd.index("gpu")] = "interpret"  # CPU: the interpreted kernels stand in
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s, cwd=REPO)
        tail = (proc.stdout + proc.stderr)[-3000:]
        code = proc.returncode
    except subprocess.TimeoutExpired as err:  # what pytest printed before it was stopped
        output = err.stdout or ""
        tail = (output.decode(errors="replace") if isinstance(output, bytes) else output)[-3000:]
        code = "timeout"
    print(tail, flush=True)
    summary = next((line for line in reversed(tail.splitlines()) if " passed" in line or " failed" in line
                    or " error" in line), str(code))
    return {"returncode": code, "summary": summary.strip("= "), "tail": tail, "seconds": time.time() - start}


def run_section(name: str, args) -> None:
    from gemm_sections import section_gemm, section_wgrad
    from layer_sections import section_bwd_sweep, section_layer

    setup = Setup(args.dry_run)
    fn = {"tests": section_tests, "layer": section_layer, "gemm": section_gemm, "bwd_sweep": section_bwd_sweep,
          "wgrad": section_wgrad}[name]
    result = {"env": env_info(), "seconds": None}
    t = time.time()
    try:
        result.update(fn(setup, args.budget_s))
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
    result["seconds"] = time.time() - t
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


# ----------------------------------------------------------------------------------------------
# The final table


def _fmt(v, width: int, digits: int = 0) -> str:
    return f"{v:{width}.{digits}f}" if isinstance(v, (int, float)) and v == v else f"{'-':>{width}s}"


def best_of(sweep: list[dict], key: str):
    rows = [(r["results"][key]["tflops"], r["config"]) for r in sweep
            if key in r.get("results", {}) and "tflops" in r["results"][key]]
    return max(rows) if rows else (None, None)


def report(results: dict) -> list[str]:
    lines = []
    env = next((r["env"] for r in results.values() if isinstance(r, dict) and "env" in r), {})
    lines.append(f"machine: {env}")
    tests = results.get("tests")
    if tests:
        lines += ["", f"GPU tests: {tests.get('summary') or tests.get('error', '')[-300:]}"]
    lines += _layer_lines(results.get("layer", {}))
    lines += _gemm_lines(results.get("gemm", {}))
    lines += _bwd_sweep_lines(results.get("bwd_sweep", {}))
    lines += _wgrad_lines(results.get("wgrad", {}))
    return lines


def _layer_lines(layer: dict) -> list[str]:
    if "routings" not in layer:
        return [f"layer section failed: {layer.get('error', 'no result')[-500:]}"] if layer else []
    from layer_sections import FUSED, FUSED_KEEP, FUSED_TORCH_WGRAD, USUAL, USUAL_COMPILED, VERDICT_BLOCK

    lines = ["", "MoE routed experts forward+backward, ms (4096 tokens x top-8, 32 experts, 7168/2048; bf16; "
             f"usual pipeline backward: {layer.get('baseline_backward')}); target: compiled usual / fused >= 1.2",
             "(fwd+bwd: one pipeline after the other, 10 steps each; x3 / x20: medians of blocks of 3 / 20 "
             f"steps taking turns after a 25 ms rest; b2b: 20-step blocks taking turns back to back, no rest "
             f"(steady state); ratios: the anchor's time over this one's, rested x{VERDICT_BLOCK} and b2b; peak MiB: "
             "one step's peak above what was allocated before it, one layer alone, so a copy kept for the "
             "backward shows only where it outlives the backward's own buffers)",
             f"{'routing':9s} {'pipeline':30s} {'fwd':>7s} {'fwd+bwd':>8s} {'x3':>7s} {'x20':>7s} {'b2b':>7s} "
             f"{'max rel err':>11s} {'usual/this':>10s} {'(b2b)':>6s} {'compiled/this':>13s} {'(b2b)':>6s} "
             f"{'peak MiB':>8s}"]

    def interleaved(v, block):
        return {int(k): ms for k, ms in v.get("interleaved_ms", {}).items()}.get(block)

    def basis(v):
        return interleaved(v, VERDICT_BLOCK) or v.get("forward_backward_ms")

    def ratio(anchor, v, key):
        if not anchor or "error" in anchor or not anchor.get("ok"):
            return None
        a, b = (basis(anchor), basis(v)) if key == "rested" else (anchor.get("back_to_back_ms"), v.get("back_to_back_ms"))
        return a / b if a and b else None
    for routing, entry in layer["routings"].items():
        usual, compiled = entry.get(USUAL), entry.get(USUAL_COMPILED)
        for name in (USUAL, USUAL_COMPILED, FUSED, FUSED_KEEP, FUSED_TORCH_WGRAD):
            v = entry.get(name)
            if v is None:
                continue
            if "error" in v:
                lines.append(f"{routing:9s} {name:30s} failed: {v['error'][:150]}")
                continue
            vs_compiled = ratio(compiled, v, "rested")
            verdict = "" if name in (USUAL, USUAL_COMPILED) or vs_compiled is None else (
                "  meets 1.2x" if vs_compiled >= 1.2 else "  BELOW 1.2x")
            lines.append(f"{routing:9s} {name:30s} {v['forward_ms']:7.2f} {v['forward_backward_ms']:8.2f} "
                         f"{_fmt(interleaved(v, 3), 7, 2)} {_fmt(interleaved(v, 20), 7, 2)} "
                         f"{_fmt(v.get('back_to_back_ms'), 7, 2)} "
                         f"{max(v['errors'].values()):11.2e}{'' if v['ok'] else ' WRONG'} "
                         f"{_fmt(ratio(usual, v, 'rested'), 10, 3)} {_fmt(ratio(usual, v, 'b2b'), 6, 3)} "
                         f"{_fmt(vs_compiled, 13, 3)} {_fmt(ratio(compiled, v, 'b2b'), 6, 3)} "
                         f"{_fmt(v.get('peak_mib'), 8)}{verdict}")
    from layer_sections import _launch_line

    for routing, entry in layer["routings"].items():
        for name in (FUSED, FUSED_KEEP):
            launches = entry.get(name, {}).get("launches")
            if not launches:
                continue
            total = sum(x["ms"] or 0 for x in launches)
            lines.append(f"  {routing}: dist-moe launches of one step of {name} (sum {total:.2f} ms; the rest is "
                         f"torch ops: routing sort, dtype casts)")
            lines += [f"    {_launch_line(x)}" for x in launches]
    for name, config in layer.get("tuned", {}).items():
        lines.append(f"  tuned {name}: {config}")
    return lines


def _gemm_lines(gemm: dict) -> list[str]:
    if "anchors" not in gemm:
        return [f"gemm section failed: {gemm.get('error', 'no result')[-500:]}"] if gemm else []
    lines = ["", "grouped GEMM forward, TFLOP/s (rows 32768, 32 experts; bf16); target: shipped / torch >= 0.95",
             f"{'shape/routing':16s} {'shipped':>8s} {'(graph)':>8s} {'host us':>8s} {'torch':>7s} {'(graph)':>8s} "
             f"{'loop':>6s} {'shipped/torch':>13s} {'sweep best':>10s}  best config"]
    for key, anchors in gemm["anchors"].items():
        shipped, torch_gmm = anchors.get("dist_moe.grouped_mm", {}), anchors.get("torch._grouped_mm", {})
        loop = anchors.get("per-expert loop", {})
        ratio = shipped["tflops"] / torch_gmm["tflops"] if "tflops" in shipped and "tflops" in torch_gmm else None
        best, config = best_of(gemm.get("sweep", []), key)
        verdict = "" if ratio is None else ("  meets" if ratio >= 0.95 else "  BELOW")
        wrong = " WRONG" if shipped.get("ok") is False else ""
        lines.append(f"{key:16s} {_fmt(shipped.get('tflops'), 8)} {_fmt(shipped.get('graph_tflops'), 8)} "
                     f"{_fmt(shipped.get('host_us'), 8)} {_fmt(torch_gmm.get('tflops'), 7)} "
                     f"{_fmt(torch_gmm.get('graph_tflops'), 8)} {_fmt(loop.get('tflops'), 6)} "
                     f"{_fmt(ratio, 13, 3)}{verdict}{wrong} {_fmt(best, 10)}  {config or ''}")
    for name, config in gemm.get("tuned", {}).items():
        lines.append(f"  tuned {name}: {config}")
    lines += _sweep_problems(gemm)
    return lines


def _sweep_problems(section: dict) -> list[str]:
    lines = []
    failed = [f"{r['config']}: {r['error']}" for r in section.get("sweep", []) if "error" in r]
    wrong = [r["config"] for r in section.get("sweep", []) if any(not v["ok"] for v in r.get("results", {}).values())]
    if failed:
        lines.append("  configs that did not run: " + "; ".join(failed))
    if wrong:
        lines.append("  configs with WRONG results: " + ", ".join(wrong))
    if section.get("budget_reached"):
        lines.append("  (sweep stopped at its time budget)")
    return lines


def _bwd_sweep_lines(sweep: dict) -> list[str]:
    if "variants" not in sweep:
        return [f"bwd_sweep section failed: {sweep.get('error', 'no result')[-500:]}"] if sweep else []
    lines = ["", "layer with one role's configuration forced (others as tuned): fwd+bwd ms, and that role's "
             "launches (ms, TFLOP/s each)",
             f"{'role':10s} {'config':40s} {'uniform':>8s} {'launch':>7s} {'skewed':>8s} {'launch':>7s}  TFLOP/s"]
    for row in sweep["variants"]:
        if "error" in row:
            lines.append(f"{row['role']:10s} {row['config']:40s} failed: {row['error'][:100]}")
            continue
        cells, rates = [], []
        for routing in ("uniform", "skewed"):
            v = row["results"].get(routing, {})
            if v and not v.get("ok"):
                cells.append(f"{'WRONG':>8s} {'':7s}")
                continue
            cells.append(f"{_fmt(v.get('forward_backward_ms'), 8, 2)} {_fmt(v.get('launch_ms'), 7, 2)}")
            rates.append(str(v.get("launch_tflops")))
        lines.append(f"{row['role']:10s} {row['config']:40s} {' '.join(cells)}  {' / '.join(rates)}")
    if sweep.get("budget_reached"):
        lines.append("  (sweep stopped at its time budget)")
    return lines


def _wgrad_lines(wgrad: dict) -> list[str]:
    if "sweep" not in wgrad:
        return [f"wgrad section failed: {wgrad.get('error', 'no result')[-500:]}"] if wgrad else []
    keys = sorted({k for r in wgrad["sweep"] for k in r.get("results", {})})
    lines = ["", "weight-gradient kernel on the layer's operands, TFLOP/s (w2: [7168 x 2048] per expert; w13: "
             "[4096 x 7168], two outputs)",
             f"{'config':56s} " + " ".join(f"{k:>14s}" for k in keys)]
    for name in ("torch._grouped_mm padded", "torch._grouped_mm"):
        cells = [wgrad.get("anchors", {}).get(k, {}).get(name, {}).get("tflops") for k in keys]
        lines.append(f"{name:56s} " + " ".join(_fmt(c, 14) for c in cells))
    for row in wgrad["sweep"]:
        if "error" in row:
            lines.append(f"{row['config']:56s} failed: {row['error'][:100]}")
            continue
        cells = [row["results"].get(k, {}) for k in keys]
        lines.append(f"{row['config']:56s} " + " ".join(
            _fmt(c.get("tflops"), 14) if c.get("ok", True) else f"{'WRONG':>14s}" for c in cells))
    lines += _sweep_problems(wgrad)
    return lines


def main() -> None:
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.section is not None:
        run_section(args.section, args)
        return
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = [s for s in SECTIONS if s != "tests" or args.tests]
    hard_limit = max(args.budget_s + 20.0, HARD_LIMIT_S) if args.budget_s > 400.0 else HARD_LIMIT_S
    results = {}
    start = time.time()
    for i, name in enumerate(sections):
        path = out_dir / f"moe_bench_{name}.json"
        path.unlink(missing_ok=True)
        elapsed = time.time() - start
        left = args.budget_s - elapsed
        rest = sum(SHARES[s] for s in sections[i:])
        budget = max(20.0, left * SHARES[name] / rest) if left > 0 else 20.0
        timeout = min(budget + SLACK_S, hard_limit - elapsed)
        if timeout < 15.0:
            results[name] = {"error": "skipped: no time left"}
            continue
        cmd = [sys.executable, __file__, "--section", name, "--json", str(path), "--budget-s", f"{budget:.0f}"]
        if args.dry_run:
            cmd.append("--dry-run")
        print(f"== section {name} (budget {budget:.0f}s, {time.time() - start:.0f}s elapsed)", flush=True)
        try:
            code = subprocess.run(cmd, timeout=timeout, env=dict(os.environ)).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        results[name] = json.loads(path.read_text()) if path.exists() else {"error": f"section exited with {code}"}
    lines = report(results)
    print(f"\n== dist-moe benchmark ({time.time() - start:.0f}s)")
    print("\n".join(lines))
    if os.environ.get("OUT"):
        (out_dir / "moe_bench.json").write_text(json.dumps({"results": results, "table": lines}, indent=1,
                                                           default=str))


if __name__ == "__main__":
    main()
