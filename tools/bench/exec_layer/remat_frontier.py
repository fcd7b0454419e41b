"""The memory-throughput frontier of activation checkpointing for Llama 3 8B on one GPU, in one run.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/exec_layer/remat_frontier.py
    (CPU check of the script:  ... remat_frontier.py --tiny)

For each batch (2, 3, 4 x 4096 tokens) it runs Llama 3 8B (bf16_params, compiled blocks, random tokens, 8
steps) under full checkpointing, today's selective modes (ops; layers every 2), no checkpointing, and
activation_checkpoint.mode=remat at several memory budgets, each in its own process (an OOM ends only
that point). It prints peak memory (torch.cuda.max_memory_allocated, from metrics.jsonl), tokens/s, the
ratio against full checkpointing at the same batch, and, per remat budget, whether the measured peak kept
to the budget and whether its throughput reached the best existing mode that fit in as much memory.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import run_job  # noqa: E402

EXISTING = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective_ops": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "ops"],
    "selective_layers2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "layers",
                          "--activation_checkpoint.every", "2"],
    "none": ["--activation_checkpoint.mode", "none"],
}


def remat(budget_gib: float) -> list[str]:
    return ["--activation_checkpoint.mode", "remat", "--activation_checkpoint.memory_budget_gib", str(budget_gib)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="debug model on CPU: checks the script")
    p.add_argument("--batches", default="2,3,4")
    p.add_argument("--budgets", default="70,90,110,130", help="remat budgets in GiB")
    args = p.parse_args()
    if args.tiny:
        model = ["--model.flavor", "debug", "--model.num_layers", "2", "--job.device", "cpu",
                 "--training.seq_len", "64", "--training.steps", "3"]
        args.batches, args.budgets = "2", "0.0275,0.05"
    else:
        model = ["--model.flavor", "8B", "--job.device", "cuda", "--training.seq_len", "4096", "--training.steps", "8",
                 "--training.mixed_precision", "bf16_params", "--compile.mode", "blocks"]
    rows = []
    for batch in args.batches.split(","):
        variants = dict(EXISTING) | {f"remat_{b}GiB": remat(float(b)) for b in args.budgets.split(",")}
        results = {}
        for name, flags in variants.items():
            r = run_job([*model, "--data.source", "random", "--training.batch_size", batch, *flags], timeout=1800)
            results[name] = r
            print(f"batch {batch} {name}: { {k: v for k, v in r.items() if k != 'plan'} }", flush=True)
        rows.append((batch, results))
    print(f"\n{'batch':>5s} {'variant':18s} {'peak GiB':>9s} {'tokens/s':>9s} {'vs full':>8s}  remat check")
    for batch, results in rows:
        full = results["full"].get("tokens_per_s")
        for name, r in results.items():
            if "error" in r:
                print(f"{batch:>5s} {name:18s} {r['error']}")
                continue
            ratio = f"{r['tokens_per_s'] / full:.3f}x" if full else "-"
            print(f"{batch:>5s} {name:18s} {r['memory_gib']:9.2f} {r['tokens_per_s']:9.0f} {ratio:>8s}  "
                  f"{_check(name, r, results)}")
    return 0


def _check(name: str, r: dict, results: dict) -> str:
    """For a remat point: budget kept (measured peak) and throughput against the best existing mode whose
    peak fits in the same memory."""
    if not name.startswith("remat_"):
        return ""
    budget = float(name.removeprefix("remat_").removesuffix("GiB"))
    fitting = [x["tokens_per_s"] for n, x in results.items()
               if n in EXISTING and "error" not in x and x["memory_gib"] <= r["memory_gib"]]
    best = max(fitting, default=None)
    plan = r.get("plan") or {}
    options = sorted({b["option"] for b in plan.get("blocks", [])})
    against = f"{r['tokens_per_s'] / best:.3f}x best existing that fits" if best else "no existing mode fits"
    return f"peak {'<=' if r['memory_gib'] <= budget else '>'} budget; {against}; plan {'/'.join(options)}"


if __name__ == "__main__":
    sys.exit(main())
