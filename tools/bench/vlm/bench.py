"""Qwen3-VL training on one GPU, titan-train against Hugging Face transformers: tokens/s, images/s, peak memory, loss (issue 19).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/vlm/bench.py
    (CPU check of the script, both sides in fp32:  uv run --frozen --no-sync python tools/bench/vlm/bench.py --tiny)

The task is the titan-train recipe qwen3_vl_debug_shapes' synthetic one: one 64x64 image of a coloured shape
drawn at run time per row (16 patches of 16x16, merged 2x2 into 4 image tokens), then its caption ("a red
circle") and EOS, right-padded to --seq tokens; the loss is on the caption only. The flavors (titan-models'
qwen3_vl, random init, seed 0):
  debug   the debug flavor: dim 256, 4 layers, 2048-token vocabulary (6.3M parameters);
  2B-7L   the 2B flavor trimmed to 7 of its 28 text layers (its whole 0.41B vision tower and 151936-token
          vocabulary; 1.07B parameters);
  2B      the 2B flavor as it is (dim 2048, 28 layers, tied embeddings; 2.13B parameters).
Per flavor, titan-models' init (seed 0) is saved as a Hugging Face folder (tm.to_hf, bf16 on the GPU), and
every variant starts from it and reads the same batches (ShapesLoader, seed 0):
  titan       titan-train's Trainer (load_recipe("qwen3_vl_debug_shapes") + apply_override, --model.hf_path the
              folder): bf16 parameters with fp32 master weights and AdamW moments (training.mixed_precision
              bf16_params, fused AdamW), the fused chunked loss and Triton kernels, no activation
              checkpointing, no torch.compile;
  hf          transformers' Qwen3VLForConditionalGeneration from the folder: bf16 weights and moments, SDPA
              attention, its own loss (caption-only labels), fused AdamW (tools/bench/hf_anchor.py);
  hf_compile  the same with torch.compile(model); a failure (compile or run) is reported as the row's error.
Both sides: the recipe's AdamW settings (betas 0.9/0.95, weight decay 0.1 on matrices, clip 1.0) and
learning rate --lr (the debug flavor keeps the recipe's 2e-3), constant after a 3-step linear warm-up.
--steps steps of --batch rows; a step is timed from a synchronised start to the loss read back after
optimizer.step, drawing its batch included (the Trainer with metrics.log_interval 1; hf_anchor.train_steps).
  tok/s     batch x seq positions per second (padding included: a row holds about 25 real tokens of the 48),
            from the median step time over the steps after --warmup (the mean is printed beside it);
  images/s  rows per second (one image each) = tok/s / seq;
  MFU       titan-train's figure for the model: 6 x every matmul parameter (vision tower included) + attention
            per position, over the GPU's dense bf16 peak (the tower really sees 16 patches per 48-position
            row, so the figure overstates its share);
  peak GiB  torch.cuda.max_memory_allocated over the variant's run;
  vs hf     tok/s over the fastest hf* variant of the same flavor;
  loss      the first step's loss -> the mean of the last 3 (every variant's loss must fall);
  gap       the largest relative loss gap to hf over the first --loss-steps steps: MISMATCH beyond --loss-rtol
            (bf16 rounding on both sides; the script exits 1);
  draw s    host seconds to draw and preprocess one step's images, timed apart (inside every step's time);
  wall s    the variant's whole run: model build or load, compilation and every step.
Estimate on an H200 (not measured here; the wall s column gives the real split): per flavor ~15 s for the
init and its save, ~30 s for titan (load, Triton kernels' first compilation, 20 steps), ~30 s for hf (eager
SDPA runs the tower's attention once per image) and 60-120 s for hf_compile (mostly compilation: the text
layers in one graph, the tower a graph per block between its per-image splits); ~4-5 minutes for the
default 2B-7L,2B. On a CPU, --tiny takes ~30 s on a quiet core; `--tiny --variants hf,hf_compile` checks the
compiled anchor there (inductor: minutes), within 1.2e-7 of eager's losses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_anchor import adamw, loss_gap, train_steps  # noqa: E402
from variant_run import measured, save_seed0_init, train_titan  # noqa: E402

FLAVORS = {"debug": ("debug", 0), "2B-7L": ("2B", 7), "2B": ("2B", 0)}  # name: (titan-models flavor, layers)
HF_VARIANTS = ("hf", "hf_compile")
WARMUP_STEPS = 3  # the lr warm-up


def titan_config(args, name: str, job: Path, hf_path: Path):
    """The recipe qwen3_vl_debug_shapes on `name`'s weights in `hf_path`, as this benchmark runs it."""
    from titan_train import load_recipe
    from titan_train.cli_args import apply_override

    run = load_recipe("qwen3_vl_debug_shapes")
    overrides = {
        "job.device": args.device, "job.folder": str(job), "job.seed": "0", "model.hf_path": str(hf_path),
        "training.steps": str(args.steps), "training.batch_size": str(args.batch), "training.seq_len": str(args.seq),
        "training.mixed_precision": "bf16_params" if args.device == "cuda" else "fp32",
        "activation_checkpoint.mode": "none", "compile.enabled": "false",
        "lr_schedule.kind": "constant", "lr_schedule.warmup_steps": str(WARMUP_STEPS),
        "checkpoint.interval": "0", "checkpoint.resume": "false", "metrics.tensorboard": "false",
        "metrics.progress": "false", "metrics.log_interval": "1",  # every step synchronised, as hf's
    }
    if FLAVORS[name][0] != "debug":
        overrides["optimizer.lr"] = str(args.lr)
    for field_name, value in overrides.items():
        apply_override(run, field_name, value)
    return run


def save_initial_weights(args, name: str, folder: Path) -> None:
    """titan-models' init of `name` (seed 0) as a Hugging Face folder, in the dtype both sides train in."""
    import titan_models as tm

    flavor, layers = FLAVORS[name]
    model_cfg = tm.flavor("qwen3_vl", flavor)
    if layers:
        model_cfg = tm.transforms.num_layers(layers)(model_cfg)
    save_seed0_init(model_cfg, folder, device=args.device, dtype=args.dtype, seq=args.seq)


def shapes_loader(args, folder: Path):
    """The loader the Trainer builds for data.source=shapes with job.seed 0, on the folder's config."""
    import titan_models as tm
    from titan_train.data.shapes import ShapesLoader
    from titan_train.data.tokenizer import ByteTokenizer

    return ShapesLoader(tm.hf.read_config(folder), ByteTokenizer(), seq_len=args.seq, seed=0)


def draw_seconds(args, folder: Path) -> float:
    """Best of 3: host seconds to draw and preprocess one step's images (inside every variant's step)."""
    loader, best = shapes_loader(args, folder), float("inf")
    for _ in range(3):
        began = time.perf_counter()
        loader.next_batch(args.batch)
        best = min(best, time.perf_counter() - began)
    return best


def run_titan(args, name: str, folder: Path) -> dict:
    out = train_titan(lambda job: titan_config(args, name, job, folder))
    last = out.pop("records")[-1]
    out["mfu_per_token_s"] = last["mfu"] / last["tokens_per_s"] if last["mfu"] else None
    return out


def hf_batches(args, folder: Path, image_token_id: int):
    """The Trainer's batches as transformers' keyword arguments: labels already shifted (shift_labels), the
    image positions marked in mm_token_type_ids (what transformers' processor returns beside input_ids)."""
    loader = shapes_loader(args, folder)
    while True:
        batch = loader.next_batch(args.batch)
        yield {"input_ids": batch.tokens, **batch.image_inputs(), "mm_token_type_ids": (batch.tokens == image_token_id).int(),
               "labels": batch.labels, "shift_labels": batch.labels}


def run_hf(args, name: str, folder: Path, variant: str) -> dict:
    import transformers
    from titan_train import load_recipe

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        folder, dtype=args.dtype, attn_implementation="sdpa").to(args.device)
    model.train()
    recipe = load_recipe("qwen3_vl_debug_shapes")
    o = recipe.optimizer
    lr = o.lr if FLAVORS[name][0] == "debug" else args.lr
    optimizer = adamw(model, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                      device=torch.device(args.device))
    forward = torch.compile(model) if variant == "hf_compile" else model
    out = train_steps(forward, optimizer, hf_batches(args, folder, model.config.image_token_id), steps=args.steps,
                      warmup=WARMUP_STEPS, clip=recipe.training.max_grad_norm, device=torch.device(args.device),
                      label=variant)
    del model, forward, optimizer
    return out


def run_variant(args, name: str, folder: Path, variant: str) -> dict:
    """One variant's figures, or {"error": ...} when it failed (the other variants still run)."""
    print(f"--- qwen3_vl {name} {variant}", flush=True)
    run = (lambda: run_titan(args, name, folder)) if variant == "titan" else (
        lambda: run_hf(args, name, folder, variant))
    out = measured(run, device=args.device, warmup=args.warmup, tokens_per_step=args.batch * args.seq)
    if "error" not in out:
        out["images_per_s"] = out["tokens_per_s"] / args.seq
    return out


def measure(args, name: str) -> dict:
    """Every variant of one flavor, from the same saved initial weights."""
    with tempfile.TemporaryDirectory(prefix="qwen3_vl_init_") as tmp:
        folder = Path(tmp)
        began = time.perf_counter()
        save_initial_weights(args, name, folder)
        print(f"--- qwen3_vl {name}: initial weights saved in {time.perf_counter() - began:.1f} s", flush=True)
        draw = draw_seconds(args, folder)
        results = {variant: run_variant(args, name, folder, variant) for variant in args.variants}
    return {"flavor": name, "draw_seconds": draw, "variants": results}


def check_rows(args, row: dict) -> list[str]:
    """Each variant's ratio to the fastest hf variant and loss gap to hf (set in place); the problems found."""
    ok = {v: r for v, r in row["variants"].items() if "error" not in r}
    anchors = [r["tokens_per_s"] for v, r in ok.items() if v in HF_VARIANTS]
    reference = ok.get("hf")
    problems = []
    for variant, r in ok.items():
        r["vs_hf"] = r["tokens_per_s"] / max(anchors) if anchors else None
        r["loss_gap"] = None
        if reference is not None and r is not reference:
            r["loss_gap"] = loss_gap(r["losses"], reference["losses"], steps=args.loss_steps)
            if r["loss_gap"] > args.loss_rtol:
                problems.append(f"{row['flavor']} {variant}: loss MISMATCH against hf ({r['loss_gap']:.2e})")
        if not r["last_loss"] < r["first_loss"]:
            problems.append(f"{row['flavor']} {variant}: the loss did not fall")
    return problems


def print_table(args, rows: list[dict], device: str) -> None:
    mfu_per_token_s = {row["flavor"]: row["variants"].get("titan", {}).get("mfu_per_token_s") for row in rows}
    print(f"\nQwen3-VL training on the shapes task, {args.batch} rows x {args.seq} positions (one 64x64 image "
          f"each), {device}, torch {torch.__version__}; medians (means) of steps {args.warmup + 1}-{args.steps}; "
          f"vs hf: against the fastest hf variant; gap: max relative loss gap to hf over steps 1-{args.loss_steps}")
    print("| flavor | variant | tok/s | images/s | step s median (mean) | draw s | MFU | peak GiB | vs hf | "
          "loss first -> last 3 | gap | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for variant, r in row["variants"].items():
            if "error" in r:
                print(f"| {row['flavor']} | {variant} | error: {r['error']} |  |  |  |  |  |  |  |  | "
                      f"{r['wall_s']:.0f} |")
                continue
            per_token = mfu_per_token_s[row["flavor"]]
            mfu = f"{100 * per_token * r['tokens_per_s']:.1f}%" if per_token else "n/a"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
            ratio = f"{r['vs_hf']:.2f}" if r["vs_hf"] is not None else "n/a"
            gap = "" if r["loss_gap"] is None else \
                f"{r['loss_gap']:.1e} {'ok' if r['loss_gap'] <= args.loss_rtol else 'MISMATCH'}"
            print(f"| {row['flavor']} | {variant} | {r['tokens_per_s']:.0f} | {r['images_per_s']:.1f} | "
                  f"{r['step_median_s']:.3f} ({r['step_mean_s']:.3f}) | {row['draw_seconds']:.3f} | {mfu} | {peak} | "
                  f"{ratio} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | {gap} | {r['wall_s']:.0f} |")
    for row in rows:
        ok = {v: r for v, r in row["variants"].items() if "error" not in r}
        anchors = [v for v in HF_VARIANTS if v in ok]
        if "titan" in ok and anchors:
            best = max(anchors, key=lambda v: ok[v]["tokens_per_s"])
            print(f"{row['flavor']}: titan {ok['titan']['vs_hf']:.2f}x the fastest transformers variant ({best})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="the debug flavor on CPU in fp32, titan and hf, a few steps (checks the script)")
    parser.add_argument("--flavors", default="2B-7L,2B", help=f"comma-separated, of {', '.join(FLAVORS)}")
    parser.add_argument("--variants", default=None,
                        help="comma-separated, of titan, hf, hf_compile (default all; --tiny: titan,hf, as inductor "
                             "takes minutes on a CPU)")
    parser.add_argument("--batch", type=int, default=128, help="rows (images) per step")
    parser.add_argument("--seq", type=int, default=48, help="positions per row (the recipe's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--lr", type=float, default=5e-4, help="learning rate of the 2B-based flavors")
    parser.add_argument("--loss-steps", type=int, default=4, help="first steps whose losses are compared with hf's")
    parser.add_argument("--loss-rtol", type=float, default=0.02, help="allowed relative loss gap to hf (bf16)")
    args = parser.parse_args()
    args.device, args.dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    variants = args.variants or ("titan,hf" if args.tiny else "titan,hf,hf_compile")
    args.flavors, args.variants = args.flavors.split(","), variants.split(",")
    if args.tiny:
        args.flavors, args.batch, args.steps, args.warmup = ["debug"], 8, 6, 2
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU check)")
    for kind, given, known in (("flavors", args.flavors, FLAVORS), ("variants", args.variants, ("titan", *HF_VARIANTS))):
        unknown = sorted(set(given) - set(known))
        if unknown:
            sys.exit(f"unknown {kind} {unknown}: choose from {', '.join(known)}")
    if not 0 <= args.warmup < args.steps:
        sys.exit(f"--warmup must be in [0, --steps); got {args.warmup} with --steps {args.steps}")
    return args


def main() -> None:
    args = parse_args()
    import transformers

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}", flush=True)
    began = time.perf_counter()
    rows = [measure(args, name) for name in args.flavors]
    problems = [p for row in rows for p in check_rows(args, row)]
    print_table(args, rows, device)
    summary = json.dumps({"bench": "qwen3_vl_train", "device": device, "torch": torch.__version__, "batch": args.batch,
                          "seq": args.seq, "steps": args.steps, "wall_s": time.perf_counter() - began, "rows": rows})
    print(summary)
    if os.environ.get("OUT"):  # the device machine brings $OUT back
        Path(os.environ["OUT"], "vlm_bench.json").write_text(summary)
    if problems:
        sys.exit("\n".join(problems))


if __name__ == "__main__":
    main()
