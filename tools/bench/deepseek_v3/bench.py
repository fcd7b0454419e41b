"""DeepSeek-V3 architecture on one GPU with dist-moe: training tokens/s and MFU with learned and forced-balance
routing, MTP on and off, in one run (issue 22).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/deepseek_v3/bench.py
    (CPU check of the script:  ... bench.py --tiny)

The model is the 16B flavor (DeepSeek-V2-Lite's shapes with DeepSeek-V3's sigmoid routing: 64 routed experts
top-6, 2 shared, MLA) trimmed to --layers layers so that its fp32 master weights and AdamW moments fit one
H200 (15.7B parameters at 16 bytes each would not: 8 layers are 4.6B, 5.2B with the MTP module; try
--layers 12, 6.9B, for the largest that fits). Each variant is the titan-train
Trainer on random tokens (bf16_params, fused AdamW, dist-moe's Triton kernels, the fused chunked loss,
selective activation checkpointing), --steps steps of --batch x --seq tokens; the figures are the mean
over the steps after --warmup. MFU counts 6 N_active per token (+ attention; titan_models.flops_per_token,
with the MTP block and its second output projection when MTP is on) against the H200's dense bf16 peak.
Forced-balance routing deals every expert the same load: the anchor that shows what the learned router's
imbalance costs, since it changes the workload (the row says so). The ratio column is against learned
routing without MTP, measured in the same run.

--experts fp8_rowwise,fp8_blockwise adds rows with the routed experts' grouped GEMMs in fp8 (dist-moe's
grouped_mm_fp8, forward and backward; titan-train's quantize.experts), learned routing without MTP, against the
same bf16 anchor (issue 21); --variants picks which of the routing/MTP rows run (e.g. learned:0).
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

VARIANTS = ("learned:0", "forced_balance:0", "learned:1", "forced_balance:1")
EXPERT_RECIPES = ("none", "fp8_rowwise", "fp8_blockwise")


def config(args, routing: str, mtp: int, experts: str, folder: Path):
    from titan_train import load_recipe
    from titan_train.cli_args import apply_override

    run = load_recipe("deepseek_v3_debug_ep")
    overrides = {
        "job.device": args.device, "job.folder": str(folder), "model.flavor": args.flavor,
        "model.num_layers": str(args.layers), "model.vocab_size": "0", "model.moe_impl": "dist_moe",
        "model.moe_routing": routing, "model.mtp_layers": str(mtp), "training.mtp_loss_weight": "0.3",
        "parallelism.ep": "1", "parallelism.dp_shard": "-1", "data.source": "random",
        "training.steps": str(args.steps), "training.batch_size": str(args.batch), "training.seq_len": str(args.seq),
        "training.mixed_precision": "bf16_params" if args.device == "cuda" else "fp32",
        "activation_checkpoint.mode": "selective" if args.device == "cuda" else "none",
        # DeepSeek-V3's own peak lr (2.2e-4) with a warm-up: the recipe's debug lr (3e-3) sent the 16B's loss
        # above ln V on random tokens (12.3 -> 13.3 on 2026-12-02), and a diverging run's router is no guide
        # to the imbalance a real one has.
        "optimizer.lr": "2.2e-4", "lr_schedule.kind": "constant", "lr_schedule.warmup_steps": "10",
        "checkpoint.interval": "0",
        "checkpoint.resume": "false", "metrics.tensorboard": "false", "metrics.progress": "false",
        "compile.enabled": "false", "quantize.experts": experts,
    }
    for name, value in overrides.items():
        apply_override(run, name, value)
    return run


def measure(args, routing: str, mtp: int, experts: str = "none") -> dict:
    from titan_train import train

    with tempfile.TemporaryDirectory() as folder:
        result = train(config(args, routing, mtp, experts, Path(folder)))
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup]
    assert all(r.get("moe_routing", "learned") == routing for r in records)
    row = {"routing": routing, "mtp": mtp, "experts": experts, "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in timed),
           "mfu": statistics.mean(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
           "memory_gib": max(r["memory_gib"] for r in records), "final_loss": result.losses[args.steps],
           "mtp_loss": records[-1].get("mtp_loss")}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="debug flavor on CPU, a few steps (checks the script)")
    parser.add_argument("--flavor", default="16B")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="routing:mtp rows, comma list of "
                        + ", ".join(VARIANTS) + " (bf16 experts)")
    parser.add_argument("--experts", default="", help="comma list of fp8 expert recipes ("
                        + ", ".join(EXPERT_RECIPES[1:]) + ") measured with learned routing, no MTP")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    experts = [e for e in args.experts.split(",") if e]
    if bad := [v for v in variants if v not in VARIANTS] + [e for e in experts if e not in EXPERT_RECIPES[1:]]:
        parser.error(f"unknown --variants/--experts {bad}; allowed: {VARIANTS} and {EXPERT_RECIPES[1:]}")
    if "learned:0" not in variants:
        variants.insert(0, "learned:0")  # the anchor of the ratio column
    args.device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.flavor, args.layers, args.batch, args.seq, args.steps, args.warmup = "debug", 3, 2, 64, 3, 1
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU check)")
    rows = []
    for variant in variants:
        routing, mtp = variant.split(":")
        rows.append(measure(args, routing, int(mtp)))
        print(f"  measured {variant}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    for recipe in experts:
        rows.append(measure(args, "learned", 0, recipe))
        print(f"  measured experts={recipe}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    anchor = rows[0]["tokens_per_s"]
    print(f"DeepSeek-V3 {args.flavor} trimmed to {args.layers} layers, {args.batch} x {args.seq} tokens/step, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}")
    print(f"{'routing':<15} {'mtp':>3} {'experts':<13} {'tok/s':>10} {'ratio':>6} {'MFU':>6} {'mem GiB':>8} {'loss':>7} {'mtp loss':>8}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mtp_loss = f"{r['mtp_loss']:.3f}" if r["mtp_loss"] is not None else "-"
        print(f"{r['routing']:<15} {r['mtp']:>3} {r['experts']:<13} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / anchor:>6.2f} "
              f"{mfu:>6} {r['memory_gib']:>8.1f} {r['final_loss']:>7.3f} {mtp_loss:>8}")


if __name__ == "__main__":
    main()
