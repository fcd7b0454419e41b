"""RL step time split into generation, weight sync and training, batch-invariant mode off then on (issue 25).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/rl/step_split.py
    (CPU check of the script:  uv run --frozen --no-sync python tools/bench/rl/step_split.py --tiny)

Each variant is titan-train's RL job (`titan_train.rl.run_rl` on the rl_sorting recipe: GRPO on sorting 3
digits, the built-in KV-cache generator) colocated on one GPU, in this one process: off (the anchor), then
generator.batch_invariant on (titan-rl's Triton kernels in the trainer and the generator). The policy is
titan-models' Llama-3 1B flavor (dim 2048, 16 layers, GQA 32/8 heads, FFN 8192) with the job's byte-level
vocabulary of 384 ids (policy.vocab_size; 0.97B parameters), from a random init (init seed 0, no pretraining,
no evaluation), fp32 master weights and fp32 compute as the job runs it (no TF32 unless --tf32), the
generator in the policy's dtype, AdamW, the KL reference kept (algorithm.track_kl, the job's default: one
more frozen forward per step). Sampling is seeded (job.seed 0 seeds torch on the device; problems come from
the seed too). A random policy rarely samples EOS, so nearly every completion runs to --new-tokens: the
workload is the same in both variants.

The figures are the job's own per-step metrics (rl_metrics.jsonl), medians over the steps after --warmup
(the first steps compile the Triton kernels):
  gen s       generation_seconds: the generator's time for the step's --prompts x --group completions;
  sync s      weight_sync_seconds: colocated, what the job does to refresh the generator: export the policy's
              full state dict and copy it into the generator's own model (update_weights, device to device;
              the job synchronizes the device before stopping the clock);
  train s     train_seconds: the update (old/reference logprobs, forward + backward, clip, AdamW step);
  step s      the whole step (also advantages and gathering);
  gen tok/s   gen_tokens_per_s (generated tokens over generation_seconds);
  train tok/s train_tokens_per_s (padded prompt + completion tokens through the update, over its time);
  ratio       the variant's step time over the anchor's (per column in the JSON line).
Measured on an H200 (2026-12-02, torch 2.11): ~4 s a step off and ~26 s a step on at the defaults (the
batch-invariant kernels in IEEE fp32 generate ~10x slower), so off takes ~1 minute and on ~5.5 minutes for 12
steps; each variant's row is printed as soon as it ends (a run cut by a time limit keeps the rows that ended);
`--steps-on N` runs the on variant for fewer steps.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

COLUMNS = ("generation_seconds", "weight_sync_seconds", "train_seconds", "step_seconds", "gen_tokens_per_s",
           "train_tokens_per_s")


def config(args, batch_invariant: bool, folder: Path, steps: int):
    from titan_train.cli_args import apply_override
    from titan_train.rl import RL_RECIPES

    run = RL_RECIPES["rl_sorting"]()
    overrides = {
        "job.device": args.device, "job.folder": str(folder), "job.seed": "0", "job.threads": "0",
        "policy.family": args.family, "policy.flavor": args.flavor, "policy.num_layers": str(args.layers),
        "policy.vocab_size": "384", "policy.init_seed": "0", "pretrain.steps": "0", "eval.problems": "0",
        "env.task": "sorting", "algorithm.name": "grpo", "algorithm.group_size": str(args.group),
        "rollout.prompts_per_step": str(args.prompts), "rollout.max_new_tokens": str(args.new_tokens),
        "rollout.max_policy_lag": "0", "generator.kind": "builtin",
        "generator.batch_invariant": str(batch_invariant).lower(), "training.steps": str(steps),
        "training.minibatches": "1", "metrics.progress": "true", "metrics.log_interval": "1",
    }
    for name, value in overrides.items():
        apply_override(run, name, value)
    return run


def measure(args, batch_invariant: bool, steps: int) -> dict:
    from titan_train.rl import run_rl

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    print(f"--- batch_invariant={batch_invariant}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        result = run_rl(config(args, batch_invariant, Path(folder), steps))
    timed = [m for m in result.curve if m["step"] > args.warmup]
    row = {"batch_invariant": batch_invariant, "steps_timed": len(timed)}
    row |= {name: statistics.median(m[name] for m in timed) for name in COLUMNS}
    row["generated_tokens_per_step"] = statistics.median(m["gen_tokens_per_s"] * m["generation_seconds"] for m in timed)
    row["completion_len"] = statistics.median(m["completion_len"] for m in timed)
    row["logprob_mismatch_max"] = max(m["logprob_mismatch_max"] for m in timed)
    row["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    row["seconds"] = result.seconds
    del result
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(args, device: str, rows: list[dict]) -> None:
    print(f"\nRL step split: {args.family} {args.flavor}{f' ({args.layers} layers)' if args.layers else ''}, "
          f"random init, GRPO on sorting, {args.prompts} prompts x {args.group} samples x <= {args.new_tokens} "
          f"new tokens, colocated, {device}; medians of the steps after {args.warmup} warm-up")
    print("| batch-invariant | steps timed | gen s | sync s | train s | step s | gen tok/s | train tok/s | "
          "step ratio | mismatch max | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        memory = f"{r['memory_gib']:.1f}" if r["memory_gib"] is not None else "-"
        print(f"| {'on' if r['batch_invariant'] else 'off'} | {r['steps_timed']} | {r['generation_seconds']:.3f} | "
              f"{r['weight_sync_seconds']:.4f} | {r['train_seconds']:.3f} | {r['step_seconds']:.3f} | "
              f"{r['gen_tokens_per_s']:.0f} | {r['train_tokens_per_s']:.0f} | {r['ratio']['step_seconds']:.2f}x | "
              f"{r['logprob_mismatch_max']:.2e} | {memory} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="Llama's debug_tied flavor on CPU, a few steps (checks the script; tied embeddings "
                             "as the default 1B flavor's, so the tied weight sync runs too)")
    parser.add_argument("--family", default="llama3")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--layers", type=int, default=0, help="override the flavor's layer count (0 keeps it)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="completion length cap")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--steps-on", type=int, default=0, help="steps of the batch-invariant variant (0: --steps)")
    parser.add_argument("--tf32", action="store_true",
                        help="allow TF32 in torch matmuls (the job's default is IEEE fp32): speeds up the off "
                             "variant only, as the batch-invariant Triton kernels keep IEEE fp32 products")
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.flavor, args.layers, args.prompts, args.group, args.new_tokens, args.steps, args.warmup = (
            "debug_tied", 2, 2, 4, 8, 3, 1)
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU check)")
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = []
    for invariant in (False, True):
        rows.append(measure(args, invariant, (args.steps_on or args.steps) if invariant else args.steps))
        rows[-1]["ratio"] = {name: rows[-1][name] / rows[0][name] if rows[0][name] else None for name in COLUMNS}
        print_table(args, device, rows)  # after each variant: a cut run keeps what ended
    print(json.dumps({"bench": "rl_step_split", "device": device, "family": args.family, "flavor": args.flavor,
                      "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                      "tf32": args.tf32, "rows": rows}))


if __name__ == "__main__":
    main()
