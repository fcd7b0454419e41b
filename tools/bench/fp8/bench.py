"""Low-precision Linear training (quantize.linear) against bf16 and torchao's float8 training: tokens/s on one GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/fp8/bench.py
    ... bench.py --steps 0 --loss-steps 300 --tokenizer-vocab 32000   (final loss on real text against bf16 only)
    ... bench.py --device cpu --flavors tiny                   (CPU check of the script)

Every variant is titan-train's Trainer on the same model, batch and data: Llama 3 with every block compiled,
bf16 parameters with fp32 master weights and moments (--training.mixed_precision bf16_params), uniform
random tokens (--data.source random: the same batches for every variant). Variants:
  bf16                 no quantisation (the baseline the speed-up is measured against);
  fp8_tensorwise, fp8_rowwise, fp8_blockwise, mxfp8
                       --quantize.linear <recipe>: every Linear but the output head;
  torchao_tensorwise, torchao_rowwise
                       torchao's convert_to_float8_training (Float8LinearConfig.from_recipe_name) on the same
                       Linears, applied to the built Trainer's model before its first step (the blocks are
                       compiled lazily, so the compiled code is torchao's): the anchor.
Flavors: "1.5B" is the train_throughput bench's model (Llama 3.2 1B's shape, untied embeddings); "8B" is
Llama 3.1 8B cut to --layers-8b layers at --batch-8b sequences (default 16 layers, 1 sequence: all 32 with
AdamW state fit one GPU only with full recomputation, --titan-args '--activation_checkpoint.mode full'; the
per-layer GEMM shapes, which decide the fp8 speed-up, are the 8B's); "tiny" is the debug model (CPU check).
Timing: the median step time over the steps after --warmup, and over --repeats runs of every variant
(interleaved); peak memory from torch.cuda.max_memory_allocated. --loss-steps N: each variant then trains N steps
on the stdlib corpus (Python's own sources), with a byte-level BPE tokenizer of --tokenizer-vocab entries trained
on that corpus (0: titan-train's byte tokenizer), and the table adds the final loss (mean of the last 10 steps)
relative to bf16's.
--profile-steps N: the first run of every variant trains N more steps after the timed ones under torch.profiler
(titan-train's --profiling.steps; left out of the timing) and prints its GPU kernel time per step by category
(fp8 GEMM, bf16 GEMM, quantise/cast/amax, attention, optimizer, other: profile_breakdown.py) and the top 15
kernels; the JSON holds them under results.<flavor>.<variant>.profile.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8")
TORCHAO = ("torchao_tensorwise", "torchao_rowwise")
FLAVORS = {"1.5B": "1.5B", "8B": "8B", "tiny": "debug"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--flavors", default="1.5B,8B", help="comma list of 1.5B, 8B, tiny")
    p.add_argument("--variants", default="bf16,fp8_tensorwise,fp8_rowwise,fp8_blockwise,torchao_tensorwise,"
                                         "torchao_rowwise",
                   help=f"comma list of bf16, {', '.join(RECIPES)}, {', '.join(TORCHAO)}")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20, help="steps per timed run, warm-up included (0: no timing)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (compile)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of every variant (interleaved)")
    p.add_argument("--layers-8b", type=int, default=16, help="layers of the 8B flavor (32: all)")
    p.add_argument("--batch-8b", type=int, default=1, help="sequences per step of the 8B flavor (memory)")
    p.add_argument("--compile", default="true", choices=("true", "false"))
    p.add_argument("--loss-steps", type=int, default=0, help="also train this many steps on stdlib text")
    p.add_argument("--tokenizer-vocab", type=int, default=32000, help="BPE vocabulary of the text runs (0: bytes)")
    p.add_argument("--titan-args", default="", help="extra titan-train CLI overrides for every variant")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many steps after the timed ones (first run of each variant; 0: none)")
    args = p.parse_args()
    if args.profile_steps < 0:
        raise SystemExit(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.device == "cpu":  # the script's own check: a few short steps
        args.batch, args.seq, args.steps, args.warmup = 2, 128, min(args.steps, 3), 1
    return args


def register_flavors() -> None:
    """The bench's 1.5B: Llama 3.2 1B untied, as tools/bench/train_throughput builds it with transformers."""
    import titan_models as tm

    flavors = tm.family("llama3").flavors
    if "1.5B" not in flavors:
        flavors["1.5B"] = dataclasses.replace(tm.flavor("llama3", "1B"), tie_embeddings=False)


def titan_flags(args, flavor: str, variant: str, job: Path, *, steps: int, text: dict | None,
                profile: int = 0) -> list[str]:
    layers = str(args.layers_8b) if flavor == "8B" else "0"
    data = ["--data.source", "random"]
    if text is not None:
        data = ["--data.source", "stdlib", "--data.tokenizer", text["tokenizer"], "--model.vocab_size",
                str(text["vocab_size"])]
    precision = "bf16_params" if args.device == "cuda" else "fp32"
    flags = [
        "--model.family", "llama3", "--model.flavor", FLAVORS[flavor], "--model.num_layers", layers, *data,
        "--job.device", args.device, "--job.folder", str(job), "--training.steps", str(steps),
        "--training.batch_size", str(batch_of(args, flavor)), "--training.seq_len", str(args.seq),
        "--training.mixed_precision", precision, "--optimizer.lr", "3e-4", "--lr_schedule.kind", "constant",
        "--lr_schedule.warmup_steps", "10", "--checkpoint.interval", "0", "--checkpoint.resume", "false",
        "--metrics.tensorboard", "false", "--metrics.progress", "false", "--metrics.plot", "false",
        "--compile.mode", "blocks" if args.compile == "true" else "none", *args.titan_args.split()]
    if variant in RECIPES:
        flags += ["--quantize.linear", variant]
    if profile:  # the last `profile` of the `steps` steps
        flags += ["--profiling.steps", ",".join(str(s) for s in range(steps - profile + 1, steps + 1))]
    return flags


def batch_of(args, flavor: str) -> int:
    return args.batch_8b if flavor == "8B" and args.device == "cuda" else args.batch


def torchao_convert(model: torch.nn.Module, variant: str) -> None:
    """torchao's float8 training on the Linears quantize.linear's default selection converts (not the head)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("torchao is not installed (pip install torchao==0.18.0)") from e

    def select(module: torch.nn.Module, fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and fqn != "output" and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    config = Float8LinearConfig.from_recipe_name(variant.removeprefix("torchao_"))
    convert_to_float8_training(model, config=config, module_filter_fn=select)


def run_variant(args, flavor: str, variant: str, *, steps: int, text: dict | None = None, profile: int = 0) -> dict:
    """Train `steps` steps (and `profile` more under the profiler); the losses, step seconds, peak memory and,
    when profiled, the kernel-time breakdown per step."""
    from titan_train.cli import parse_args as parse_train_args
    from titan_train.trainer import Trainer

    device = torch.device(args.device)
    job = Path(tempfile.mkdtemp(prefix="fp8_bench_"))
    config, _ = parse_train_args(titan_flags(args, flavor, variant, job, steps=steps + profile, text=text,
                                             profile=profile))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(config, device)
    if variant in TORCHAO:
        torchao_convert(trainer.model, variant)
    trainer.run()
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del trainer
    torch._dynamo.reset()
    out = {"losses": [r["loss"] for r in records], "seconds": [r["step_seconds"] for r in records], "peak_gib": peak}
    if profile:
        out["profile"] = profiled(job / "profile" / "trace_rank0.json", steps=profile)
        out["profile"]["step_ms"] = statistics.median(out["seconds"][steps:]) * 1e3
    return out


def profiled(trace: Path, *, steps: int) -> dict:
    from profile_breakdown import breakdown, kernels_from_trace

    from titan_train.trace_summary import load_events, summarize

    events = load_events(trace)
    result = breakdown(kernels_from_trace(events), steps=steps)
    window = summarize(events)  # the device's busy (union of kernels) and idle time over the profiled window
    result["busy_ms"], result["idle_ms"] = window["compute_ms"] / steps, window["idle_ms"] / steps
    trace.unlink()  # tens of MB per variant: the breakdown is what the bench keeps
    return result


def stdlib_tokenizer(vocab: int) -> dict:
    """A byte-level BPE tokenizer trained on the stdlib corpus (titan-train's loader reads its tokenizer.json)."""
    if vocab == 0:
        return {"tokenizer": "byte", "vocab_size": 0}
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_train.data import open_documents

    began = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    documents = open_documents("stdlib")  # bytes per file
    tokenizer.train_from_iterator((documents[i].decode("utf-8", errors="replace") for i in range(len(documents))),
                                  trainer, length=len(documents))
    path = Path(tempfile.mkdtemp(prefix="fp8_bench_tok_")) / "tokenizer.json"
    tokenizer.save(str(path))
    size = tokenizer.get_vocab_size()
    print(f"tokenizer: BPE {size} entries on the stdlib corpus ({time.perf_counter() - began:.0f} s)", flush=True)
    return {"tokenizer": str(path), "vocab_size": -(-(size + 1) // 128) * 128}


def timed(args, flavor: str, variants: list[str]) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats if args.steps else 0):
        for variant in variants:
            print(f"== {flavor} {variant} (run {repeat + 1}/{args.repeats})", flush=True)
            try:
                profile = args.profile_steps if repeat == 0 else 0
                out = run_variant(args, flavor, variant, steps=args.steps, profile=profile)
                runs[variant].append(out)
                step_s = statistics.median(out["seconds"][args.warmup:args.steps])
                # printed as each run ends, so a run cut by a time limit still gives its finished variants
                print(f"== {flavor} {variant}: {step_s * 1e3:.1f} ms/step, "
                      f"{batch_of(args, flavor) * args.seq / step_s:,.0f} tok/s, peak {out['peak_gib']:.1f} GiB",
                      flush=True)
            except Exception as e:  # one failing variant must not cost the others' figures
                print(f"== {flavor} {variant} FAILED: {type(e).__name__}: {e}", flush=True)
                torch._dynamo.reset()
    results = {}
    tokens = batch_of(args, flavor) * args.seq
    for variant, outs in runs.items():
        if outs:
            step_s = statistics.median(statistics.median(o["seconds"][args.warmup:args.steps]) for o in outs)
            results[variant] = {"tokens_per_s": tokens / step_s, "step_s": step_s,
                                "peak_gib": max(o["peak_gib"] for o in outs), "losses": outs[0]["losses"]}
            if "profile" in outs[0]:
                results[variant]["profile"] = outs[0]["profile"]
    return results


def with_text_losses(args, flavor: str, results: dict[str, dict], text: dict, variants: list[str]) -> None:
    for variant in variants:
        print(f"== {flavor} {variant}: {args.loss_steps} steps on stdlib text", flush=True)
        try:
            out = run_variant(args, flavor, variant, steps=args.loss_steps, text=text)
        except Exception as e:
            print(f"== {flavor} {variant} text run FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        entry = results.setdefault(variant, {})
        entry["final_loss"] = statistics.fmean(out["losses"][-10:])
        entry["text_losses"] = out["losses"]


def table(args, flavor: str, results: dict[str, dict]) -> str:
    base = results.get("bf16", {})
    anchors = [results[v] for v in TORCHAO if "tokens_per_s" in results.get(v, {})]
    anchor = max(anchors, key=lambda r: r["tokens_per_s"]) if anchors else None
    layers = f"{args.layers_8b} layers, " if flavor == "8B" else ""
    lines = [f"\n### Llama 3 {flavor} ({layers}batch {batch_of(args, flavor)} x {args.seq})\n",
             "| variant | tok/s | step ms | vs bf16 | vs torchao best | peak GiB | final loss | vs bf16 loss |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        speed = ["", "", "", "", ""]
        if "tokens_per_s" in r:
            ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "tokens_per_s" in base else "n/a"
            vs_ao = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x" if anchor else "n/a"
            speed = [f"{r['tokens_per_s']:.0f}", f"{r['step_s'] * 1e3:.1f}", ratio, vs_ao, f"{r['peak_gib']:.1f}"]
        loss = f"{r['final_loss']:.4f}" if "final_loss" in r else ""
        gap = (f"{(r['final_loss'] - base['final_loss']) / base['final_loss']:+.2%}"
               if "final_loss" in r and "final_loss" in base else "")
        lines.append("| " + " | ".join([name, *speed, loss, gap]) + " |")
    return "\n".join(lines)


def profile_tables(flavor: str, results: dict[str, dict]) -> list[str]:
    from profile_breakdown import format_breakdown

    return [format_breakdown(f"{flavor} {variant}", r["profile"], step_ms=r["profile"]["step_ms"])
            for variant, r in results.items() if "profile" in r]


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --flavors tiny to check the script", file=sys.stderr)
        return 2
    register_flavors()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}", flush=True)
    variants = args.variants.split(",")
    unknown = set(variants) - {"bf16", *RECIPES, *TORCHAO}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}")
    text = stdlib_tokenizer(args.tokenizer_vocab) if args.loss_steps else None
    summary, tables = {}, []
    for flavor in args.flavors.split(","):
        results = timed(args, flavor, variants)
        if text is not None:
            with_text_losses(args, flavor, results, text, variants)
        summary[flavor] = results
        tables.append(table(args, flavor, results))
        tables += profile_tables(flavor, results)
    print("\n".join(tables))
    out = os.environ.get("OUT")
    if out:
        Path(out, "fp8_bench.json").write_text(json.dumps({"args": vars(args), "device": name,
                                                           "torch": torch.__version__, "results": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
