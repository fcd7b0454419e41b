"""The memory-throughput frontier of activation checkpointing for Llama 3 8B on one H200, in one run.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/exec_layer/remat_frontier.py [--grid]
    (CPU check of the script:  ... remat_frontier.py --tiny; its peaks are not the GPU's allocator's)

Each point is one titan-train process (an OOM ends only that point) running Llama 3 8B (all 32 layers;
--layers trims them, keeping the 8B's per-layer shapes) on random tokens, compiled blocks, 6 steps, with
the memory-saving settings a strong user picks (tools/bench/train_throughput's titan_compile_lean):
bf16_params, AdamW moments in bf16, 2048-token loss chunks with a bf16 output-weight gradient sum. Its
state is 10 bytes a parameter through the forward (bf16 weight, fp32 master, two bf16 moments) and 12 with
the bf16 gradients: 74.8 + 15.0 = 89.8 GiB for the 8.03B parameters (without the lean settings, fp32
moments, it would be 119.7 GiB and hardly any point would fit). The script prints these figures.

Default (one GPU call, ~7 minutes): batch 2 x 4096 under full checkpointing, selective ops and none, and
activation_checkpoint.mode=remat at three memory levels: the counted peaks of full, ops and none (+1 GiB
of allocator slack, rounded up to 0.5; no lower than the planner's floor, 90.4 GiB at batch 2), so each remat
point meets the existing mode that fits there; they run by memory, each level after its mode (full,
remat_92.5GiB, ops, remat_101GiB, none, remat_123GiB). A point takes
~60-75 s (start and imports ~10 s, 8B materialized ~10 s, compile ~30-40 s, 6 steps of ~1.0-1.4 s), 6
points ~7 min; a point stops after --point-timeout (150 s) and none starts past --deadline (480 s), so a
cut run still prints every line that ended. --grid runs batches 2, 3, 4 with selective layers (every 2)
too and remat also at the top level (--capacity minus 4 GiB): 8 points at batch 2 (~9-10 min), 6 at
batches 3 and 4 (none is predicted OOM there; ~7 min each): one batch per GPU call, e.g.
--grid --batches 3 --deadline 520.

--modes picks the existing modes (e.g. --modes full,ops --budgets 130,138: the top of the frontier at one
batch without none's predicted OOM). Each process runs with the trainer's CUDA allocator default
(expandable segments, titan_train/cli.py) unless PYTORCH_CUDA_ALLOC_CONF says otherwise; 'reserved' is the
allocator's peak beside the allocated one, and an OOM prints the allocator's account of it.

Memory levels and the budget: activation_checkpoint.memory_budget_gib is the TOTAL peak the remat planner
aims at (weights + gradients + moments + saved activations; titan_train/remat/apply.py), not an activation
budget; a remat point is called with the level as its budget, its measured peak is checked against it, and
it is compared with the best existing mode whose measured peak is within the same level. (The planner
counts the gradients only from the backward on, when the saved activations are being freed, and reserves the
backward's transient and the loss buffers: titan_train/remat/peak.py.)
frontier_memory.py counts each point's peak (memory_model.py's layouts); a point counted above --capacity
prints 'predicted OOM' and does not run. Measured peak: torch.cuda.max_memory_allocated (metrics.jsonl).
The last table gives, per variant, the largest batch of the run that fit.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import run_job  # noqa: E402
from frontier_memory import GIB, Shape, peak, remat_peak  # noqa: E402

EXISTING = {
    "full": ["--activation_checkpoint.mode", "full"],
    "ops": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "ops"],
    "layers2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "layers",
                "--activation_checkpoint.every", "2"],
    "none": ["--activation_checkpoint.mode", "none"],
}
COUNTED = {"full": "full", "ops": "ops", "layers2": "layers", "none": "none"}  # frontier_memory's mode names
LEAN = ["--training.loss_chunk_size", "2048", "--training.loss_weight_grad_dtype", "param"]
SLACK_GIB = 1.0  # the allocator's, over the counted peak (memory_model.py)


@dataclass(frozen=True)
class Point:
    name: str
    flags: list[str]
    predicted_gib: float
    budget_gib: float | None = None  # remat: its level
    skip: str = ""  # why it does not run (predicted OOM, below the planner's minimum)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="debug model (2 layers, 256 tokens, CPU, fp32): checks it")
    p.add_argument("--grid", action="store_true", help="batches 2,3,4, every mode, remat at 4 levels (~15 min/batch)")
    p.add_argument("--batches", default="", help="comma list (default 2; --grid: 2,3,4)")
    p.add_argument("--budgets", default="", help="remat budgets in GiB, total (default: the levels above)")
    p.add_argument("--modes", default="", help=f"existing modes to run, comma list of {','.join(EXISTING)} "
                   "(default full,ops,none; --grid: all); --budgets is then needed if ops or none is left out")
    p.add_argument("--layers", type=int, default=0, help="layers of the 8B (0: all 32)")
    p.add_argument("--steps", type=int, default=6, help="steps a point; tokens/s is the median after two")
    p.add_argument("--capacity", type=float, default=139.0, help="GiB the device holds")
    p.add_argument("--point-timeout", type=float, default=150.0, help="seconds a point may take")
    p.add_argument("--deadline", type=float, default=480.0, help="no point starts after this many seconds")
    args = p.parse_args(argv)
    args.batches = args.batches or ("2,3,4" if args.grid else "2")
    modes = [m for m in args.modes.split(",") if m] or (list(EXISTING) if args.grid else ["full", "ops", "none"])
    unknown = sorted(set(modes) - set(EXISTING))
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(EXISTING)}")
    if not args.budgets and not {"full", "ops", "none"} <= set(modes):
        p.error("--modes without full, ops and none needs --budgets (the default levels are those modes' peaks)")
    args.modes = modes
    return args


def model_setup(args) -> tuple[list[str], Shape]:
    """The titan-train flags of the model and precision, and the Shape frontier_memory counts them with."""
    import titan_models

    flavor = "debug" if args.tiny else "8B"
    cfg = titan_models.flavor("llama3", flavor)
    layers = args.layers or (2 if args.tiny else cfg.num_layers)
    shape = dict(dim=cfg.dim, layers=layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, ffn=cfg.ffn_dim,
                 vocab=cfg.vocab_size)
    # --model.vocab_size: the default recipe's 384 (its byte tokenizer's) would replace the flavor's
    flags = ["--model.flavor", flavor, "--model.num_layers", str(layers), "--model.vocab_size", str(cfg.vocab_size),
             "--training.steps", str(args.steps),
             "--data.source", "random", *LEAN]
    if args.tiny:  # fp32 on CPU: 4-byte weights and gradients, fp32 moments
        flags += ["--job.device", "cpu", "--training.seq_len", "256", "--compile.mode", "none"]
        return flags, Shape(**shape, value_bytes=4, forward_state_bytes=12, grad_bytes=4, loss_weight_grad_bytes=4,
                            loss_logit_bytes=8, **_planner_keep(cfg, 256, torch.float32, grad_bytes=4))
    flags += ["--job.device", "cuda", "--training.seq_len", "4096", "--compile.mode", "blocks",
              "--training.mixed_precision", "bf16_params", "--optimizer.moment_dtype", "bfloat16"]
    return flags, Shape(**shape, **_planner_keep(cfg, 4096, torch.bfloat16, grad_bytes=2, compiled=True, fused=True))


def _planner_keep(cfg, seq_len: int, dtype, *, grad_bytes: int, compiled: bool = False,
                  fused: bool = False) -> dict[str, int]:
    """One block as the remat planner profiles it (on meta: no memory, no compute; held.py), each figure as a
    fixed part (the weight concatenations a kept block's products save) + a part per token, profiled at one and
    two rows: a kept block's saved bytes (compiled: as a compiled block) and backward transient, and the first
    block's least backward high mark over the options with the share of its gradients (grad_bytes a parameter)
    made by then (the planner's floor, peak.py backward_floor; compiled, only keep's saved bytes are the
    compiled block's: one compile a row count is ~7 s, not four). fused: with the fused SwiGLU, as the trainer
    gives CUDA runs (training.fused_kernels; kernels/swiglu.py: on meta its backward allocates as the kernel)."""
    import titan_models
    from titan_train.kernels.swiglu import use_fused_swiglu
    from titan_train.remat import profile_blocks
    from titan_train.remat.plan import OPTIONS, choose

    with torch.device("meta"):
        model = titan_models.transforms.num_layers(1)(cfg).build()
    if fused:
        use_fused_swiglu(model)
    own = grad_bytes * sum(p.numel() for p in model.layers["0"].parameters())
    figures = {}
    for rows in (1, 2):
        eager = profile_blocks(model, rows=rows, seq_len=seq_len, dtype=dtype)[0]
        if compiled:
            eager.held[None] = profile_blocks(model, rows=rows, seq_len=seq_len, dtype=dtype, compiled=True,
                                              only=(None,))[0].held[None]
        keep = choose(eager, "keep", None)
        floor = min(c.saved_bytes + c.backward_transient_bytes + math.ceil(c.grad_share * own)
                    for c in (choose(eager, n, o) for n, o in OPTIONS.items()))
        figures[rows] = (keep.saved_bytes, keep.backward_transient_bytes, floor)
    names = ("keep", "keep_transient", "floor_block")
    out = {}
    for name, one, two in zip(names, figures[1], figures[2], strict=True):
        out[f"planner_{name}_bytes_per_token"] = (two - one) // seq_len
        out[f"planner_{name}_fixed_bytes"] = 2 * one - two
    return out


def plan_points(shape: Shape, tokens: int, args) -> list[Point]:
    """The existing modes of the run, then remat at each level, each with its counted peak."""
    names = args.modes
    counted = {n: peak(shape, tokens, COUNTED[n]) / GIB for n in names}
    points = [Point(n, EXISTING[n], counted[n]) for n in names]
    if args.budgets:
        levels = [float(b) for b in args.budgets.split(",")]
    else:
        slack = min(SLACK_GIB, 0.05 * counted["full"])  # the tiny model's peaks are MiB
        top = args.capacity - 4  # the grid's top level: what is left for remat past the existing modes
        # no lower than the planner accepts (peak.py backward_floor: the end of the backward, or its walk at
        # the first block: every gradient but the embedding's and that block's unmade share, + its high mark)
        floor = shape.planner_floor_bytes(tokens) / GIB
        levels = [_round_up(max(counted[n] + slack, floor)) for n in names
                  if n != "layers2" and counted[n] <= args.capacity]
        levels = sorted({lv for lv in levels if lv < top} | ({top} if args.grid else set()))
    planner_floor = shape.planner_floor_bytes(tokens) / GIB
    for level in levels:
        predicted = remat_peak(shape, tokens, int(level * GIB)) / GIB
        skip = f"budget below the planner's floor ({planner_floor:.2f} GiB)" if level < planner_floor else ""
        points.append(Point(f"remat_{level:g}GiB", _remat_flags(level), predicted, level, skip))
    points = [p if p.skip or p.predicted_gib <= args.capacity else
              Point(p.name, p.flags, p.predicted_gib, p.budget_gib, "predicted OOM") for p in points]
    # by memory: each remat level right after the mode it meets, so a run cut short keeps whole pairs
    return sorted(points, key=lambda p: p.predicted_gib if p.budget_gib is None else p.budget_gib)


def _round_up(gib: float) -> float:
    step = 0.5 if gib >= 4 else 0.0001  # the tiny model's levels differ by MiB
    return round(math.ceil(gib / step) * step, 4)


def _remat_flags(budget_gib: float) -> list[str]:
    return ["--activation_checkpoint.mode", "remat", "--activation_checkpoint.memory_budget_gib", str(budget_gib)]


def run_points(points: list[Point], model: list[str], batch: int, args, began: float) -> dict[str, dict]:
    """Each point in its own process, its line printed as soon as it ends (a cut run keeps what ended)."""
    results = {}
    for p in points:
        left = args.deadline - (time.perf_counter() - began)
        if p.skip or left <= 0:
            r = {"error": p.skip or "not started: past --deadline"}
        else:
            r = run_job([*model, "--training.batch_size", str(batch), *p.flags],
                        timeout=min(args.point_timeout, max(left, 30.0)))
        results[p.name] = r
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "plan"}
        print(f"batch {batch} {p.name} (pred {_gib(p.predicted_gib).strip()} GiB): {shown}", flush=True)
        if p.budget_gib is not None and "error" not in r:  # against the modes run so far (its own ran just before)
            print(f"batch {batch} {p.name}: {remat_check(p, r, results)}", flush=True)
    return results


def _gib(value: float) -> str:
    return f"{value:9.2f}" if value >= 1 else f"{value:9.4f}"  # the tiny model's differ by MiB


def print_table(batch: int, points: list[Point], results: dict[str, dict]) -> None:
    print(f"\nbatch {batch}: {'variant':16s} {'pred GiB':>9s} {'peak GiB':>9s} {'reserved':>9s} {'tokens/s':>9s} "
          f"{'vs full':>8s}  remat check")
    full = results.get("full", {}).get("tokens_per_s")
    for p in points:
        r = results[p.name]
        if "error" in r:
            print(f"batch {batch}: {p.name:16s} {_gib(p.predicted_gib)} {r['error']}")
            continue
        ratio = f"{r['tokens_per_s'] / full:.3f}x" if full else "-"
        print(f"batch {batch}: {p.name:16s} {_gib(p.predicted_gib)} {_gib(r['memory_gib'])} {_gib(r['reserved_gib'])} "
              f"{r['tokens_per_s']:9.0f} "
              f"{ratio:>8s}  {remat_check(p, r, results)}")


def remat_check(point: Point, r: dict, results: dict[str, dict]) -> str:
    """A remat point at level B (its total budget): measured peak <= B, and its throughput against the best
    existing mode whose measured peak is <= B (the same meaning of memory)."""
    if point.budget_gib is None:
        return ""
    level = point.budget_gib
    fitting = {n: x["tokens_per_s"] for n, x in results.items()
               if n in EXISTING and "error" not in x and x["memory_gib"] <= level}
    best = max(fitting, key=fitting.get, default=None)
    against = (f"{r['tokens_per_s'] / fitting[best]:.3f}x {best} (best existing <= {level:g} GiB)" if best
               else f"no existing mode measured <= {level:g} GiB")
    plan = r.get("plan") or {}
    counts: dict[str, int] = {}
    for b in plan.get("blocks", []):
        counts[b["option"]] = counts.get(b["option"], 0) + 1
    planned = plan.get("planned_total_bytes")
    planned = (f", planned {_gib(planned / GIB).strip()} (measured {r['memory_gib'] - planned / GIB:+.2f} GiB from it)"
               if planned else "")
    return (f"peak {'<=' if r['memory_gib'] <= level else '>'} budget{planned}; {against}; "
            f"plan {', '.join(f'{n} {o}' for o, n in sorted(counts.items())) or '?'}")


def print_largest_batches(rows: list[tuple[int, dict[str, dict]]]) -> None:
    """Per variant (remat: any level), the largest batch of this run that ran to the end."""
    largest: dict[str, int] = {}
    for batch, results in rows:
        for name, r in results.items():
            key = "remat (any level)" if name.startswith("remat_") else name
            if "error" not in r:
                largest[key] = max(largest.get(key, 0), batch)
    print("\nlargest batch that fit: " + (", ".join(f"{k} {v}" for k, v in largest.items()) or "none"))


def main(argv=None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    model, shape = model_setup(args)
    seq = 256 if args.tiny else 4096
    n = shape.parameters
    print(f"Llama 3 {'debug' if args.tiny else '8B'}, {shape.layers} layers, {n / 1e9:.3f}B parameters; state "
          f"{n * shape.forward_state_bytes / GIB:.2f} GiB through the forward ({shape.forward_state_bytes} B/param) + "
          f"{n * shape.grad_bytes / GIB:.2f} GiB gradients = {shape.planner_static_bytes / GIB:.2f} GiB at the end of "
          "the backward; the remat planner counts the gradients from the backward on (None through the forward) "
          f"and prices a kept block at {shape.planner_keep_bytes_per_token} B/token + "
          f"{shape.planner_keep_fixed_bytes / GIB:.3f} GiB, its backward transient at "
          f"{shape.planner_keep_transient_bytes_per_token} B/token; capacity "
          f"{args.capacity:g} GiB", flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        points = plan_points(shape, batch * seq, args)
        rows.append((batch, points, run_points(points, model, batch, args, began)))
    for batch, points, results in rows:
        print_table(batch, points, results)
    print_largest_batches([(b, r) for b, _, r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
