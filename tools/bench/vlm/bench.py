"""Qwen3-VL in training on one GPU: tokens/s, images/s, MFU, peak memory and the loss, debug up to 2B (issue 19).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/vlm/bench.py
    (CPU check of the script:  uv run --frozen --no-sync python tools/bench/vlm/bench.py --tiny)

Each variant is the titan-train Trainer (load_recipe("qwen3_vl_debug_shapes") + apply_override) on the recipe's
synthetic task: one 64x64 image of a coloured shape drawn at run time per row (16 patches of 16x16, merged 2x2
into 4 image tokens), then its caption ("a red circle") and EOS, right-padded to --seq tokens; the loss is on the
caption only. The flavors (titan-models' qwen3_vl, random init, seed 0):
  debug   the debug flavor: dim 256, 4 layers, 2048-token vocabulary (6.3M parameters);
  2B-7L   the 2B flavor trimmed to 7 of its 28 text layers (its whole 0.41B vision tower and 151936-token
          vocabulary; 1.07B parameters);
  2B      the 2B flavor as it is (dim 2048, 28 layers, tied embeddings; 2.13B parameters).
bf16 parameters with fp32 master weights and AdamW moments (training.mixed_precision=bf16_params, fused AdamW),
titan-train's fused chunked loss and Triton kernels, no activation checkpointing, no torch.compile; learning
rate --lr (constant after a 3-step warmup; the debug flavor keeps the recipe's 2e-3). --steps steps of --batch
rows; throughput is the mean over the steps after --warmup.
  tok/s     titan-train's tokens_per_s: batch x seq positions per second (padding included: a row holds about
            25 real tokens of the 48);
  images/s  rows per second (one image each) = tok/s / seq;
  MFU       titan-train's figure: 6 x every matmul parameter (vision tower included) + attention per position,
            over the H200's dense bf16 peak; the vision tower really sees 16 patches per 48-position row, so
            the figure overstates its share;
  draw s    host seconds to draw and preprocess one step's images, timed apart (the trainer draws them
            inline, overlapping the GPU's previous step; a step cannot be faster than this);
  mem GiB   the trainer's peak memory_gib;
  loss      the first step's loss -> the mean of the last 3 (the loss must fall: the script checks it).
Estimate on an H200 (not measured here): well under a minute for debug, 1-2 minutes each for 2B-7L and 2B
including model builds, so ~3-4 minutes in all.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

FLAVORS = {"debug": ("debug", 0), "2B-7L": ("2B", 7), "2B": ("2B", 0)}  # name: (titan-models flavor, layers)


def config(args, name: str, folder: Path):
    from titan_train import load_recipe
    from titan_train.cli_args import apply_override

    flavor, layers = FLAVORS[name]
    run = load_recipe("qwen3_vl_debug_shapes")
    overrides = {
        "job.device": args.device, "job.folder": str(folder), "job.seed": "0",
        "model.flavor": flavor, "model.num_layers": str(layers), "model.init_seed": "0",
        "training.steps": str(args.steps), "training.batch_size": str(args.batch), "training.seq_len": str(args.seq),
        "training.mixed_precision": "bf16_params" if args.device == "cuda" else "fp32",
        "activation_checkpoint.mode": "none", "compile.enabled": "false",
        "lr_schedule.kind": "constant", "lr_schedule.warmup_steps": "3",
        "checkpoint.interval": "0", "checkpoint.resume": "false", "metrics.tensorboard": "false",
        "metrics.progress": "true", "metrics.log_interval": "5",
    }
    if flavor != "debug":
        overrides["optimizer.lr"] = str(args.lr)
    for field_name, value in overrides.items():
        apply_override(run, field_name, value)
    return run


def draw_seconds(args, name: str) -> float:
    """Best of 3: host seconds to draw and preprocess one step's images (the trainer does it inline, between
    launching one step's GPU work and the next, so it overlaps the GPU unless it takes longer)."""
    import titan_models as tm
    from titan_train.data.shapes import ShapesLoader
    from titan_train.data.tokenizer import ByteTokenizer

    loader = ShapesLoader(tm.flavor("qwen3_vl", FLAVORS[name][0]), ByteTokenizer(), seq_len=args.seq, seed=1)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        loader.next_batch(args.batch)
        best = min(best, time.perf_counter() - began)
    return best


def measure(args, name: str) -> dict:
    from titan_train import train

    print(f"--- qwen3_vl {name}", flush=True)
    draw = draw_seconds(args, name)
    with tempfile.TemporaryDirectory() as folder:
        result = train(config(args, name, Path(folder)))
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup]
    tokens_per_s = statistics.mean(r["tokens_per_s"] for r in timed)
    losses = [result.losses[s] for s in sorted(result.losses)]
    row = {"flavor": name, "tokens_per_s": tokens_per_s, "images_per_s": tokens_per_s / args.seq,
           "step_seconds": statistics.mean(r["step_seconds"] for r in timed), "draw_seconds": draw,
           "mfu": statistics.mean(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
           "memory_gib": max(r["memory_gib"] for r in records), "first_loss": losses[0],
           "last_loss": statistics.mean(losses[-3:]), "losses": losses}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the debug flavor on CPU, a few steps (checks the script)")
    parser.add_argument("--flavors", default="debug,2B-7L,2B", help=f"comma-separated, of {', '.join(FLAVORS)}")
    parser.add_argument("--batch", type=int, default=128, help="rows (images) per step")
    parser.add_argument("--seq", type=int, default=48, help="positions per row (the recipe's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the throughput means")
    parser.add_argument("--lr", type=float, default=5e-4, help="learning rate of the 2B-based flavors")
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    names = args.flavors.split(",")
    if args.tiny:
        names, args.batch, args.steps, args.warmup = ["debug"], 8, 8, 2
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU check)")
    unknown = sorted(set(names) - set(FLAVORS))
    if unknown:
        sys.exit(f"unknown flavors {unknown}: choose from {', '.join(FLAVORS)}")
    rows = [measure(args, name) for name in names]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nQwen3-VL training on the shapes task, {args.batch} rows x {args.seq} positions (one 64x64 image "
          f"each), {'bf16_params' if args.device == 'cuda' else 'fp32'}, {device}; means of steps "
          f"{args.warmup + 1}-{args.steps}")
    print("| flavor | tok/s | images/s | step s | draw s | MFU | peak GiB | loss first -> last 3 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"| {r['flavor']} | {r['tokens_per_s']:.0f} | {r['images_per_s']:.1f} | {r['step_seconds']:.3f} | "
              f"{r['draw_seconds']:.3f} | {mfu} | {r['memory_gib']:.1f} | "
              f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    print(json.dumps({"bench": "qwen3_vl_train", "device": device, "batch": args.batch, "seq": args.seq,
                      "steps": args.steps, "rows": rows}))
    falling = [r["flavor"] for r in rows if not r["last_loss"] < r["first_loss"]]
    if falling:
        sys.exit(f"the loss did not fall for {falling}")


if __name__ == "__main__":
    main()
