"""Qwen3.5 dense ~1B training on one GPU, titan-train against Hugging Face transformers: tokens/s, MFU, peak
memory, loss (issue 17). The training-step counterpart of bench_delta_rule.py (one layer's kernels).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/gated_deltanet/train_qwen35.py
    (CPU check of the script, both sides in fp32, the Triton kernels under TRITON_INTERPRET=1:
     uv run --frozen --no-sync python tools/bench/gated_deltanet/train_qwen35.py --tiny)

The model (titan-models' qwen3_5 family, random init, seed 0) is Qwen3.5-35B-A3B's layer shapes made dense
and cut to --layers: hidden 2048; the family's schedule of 3 Gated DeltaNet layers then 1 gated-attention
layer (16 layers: 12 + 4); Gated DeltaNet with 16 key heads and 32 value heads of 128 (35B-A3B's); gated
attention with 16 query / 2 key-value heads of 256, RoPE on a quarter of each head; SwiGLU of width --ffn
(4096) in place of the experts; a --vocab (32768) vocabulary, untied. That is 1.05B parameters at the defaults
(no published Qwen3.5 flavor has this size, so the script builds it and titan-models gains no flavor).
`--tiny`: the qwen3_5 debug flavor (dim 256, 4 layers alternating linear and full attention, 384 tokens).

titan-models' init is saved as a Hugging Face folder (tm.to_hf, bf16 on the GPU); both sides start from it
and read the same batches (--data stdlib: Python's standard library packed by titan-train's byte tokenizer
and loader, seed 0, no document masking on either side, so the loss falls; random: uniform random tokens):
  titan  titan-train's Trainer (load_recipe("qwen3_5_debug") + apply_override, --model.hf_path the folder):
         bf16 parameters with fp32 master weights and AdamW moments (training.mixed_precision bf16_params,
         whose AdamW is one fused Triton pass a step, titan_train/kernels/adamw.py), titan-models' Triton
         Gated DeltaNet kernels (forward and backward), the fused chunked loss, no activation checkpointing,
         no torch.compile;
  hf     transformers' Qwen3_5ForCausalLM from the folder: bf16 weights and moments, SDPA attention, its own
         loss, fused AdamW (tools/bench/hf_anchor.py). The GPU image has no flash-linear-attention usable for
         backward (fla-core's backward refuses triton 3.6 on Hopper) and no causal-conv1d, so transformers runs
         its torch forms of the chunked delta rule and the short conv (the header says which it found).
Both: AdamW betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices, clip 1.0 (the recipe's), learning rate
--lr, constant after a 3-step linear warm-up. A step is timed from a synchronised start to the loss read back
after optimizer.step, its batch drawn inside it (the Trainer with metrics.log_interval 1; hf_anchor).

Shapes: the anchor's torch fallback keeps fp32 copies of every per-chunk tensor for backward: counted on a
CPU (saved-tensor hooks, one decoder layer of this shape in bf16), 0.52 GiB per 1024 tokens per Gated
DeltaNet layer (its MLP included), i.e. ~100 GiB of activations for 12 such layers at 4 x 4096 tokens,
leaving too little of the H200's ~139 GiB for the attention layers, weights, moments, logits and
backward's transients (an estimate, not tried on the GPU). So by default titan runs the 1B at --batch 4 x
4096 (its row, no ratio), and both sides run it again at --anchor-batch 2 x 4096 (the ratio);
--anchor-batch 4 compares at the full batch, --anchor-layers N on N layers. A ratio only ever compares one
shape; a failed variant (out of memory, say) prints its error in its row and the others still run.
  tok/s     batch x seq tokens / the median step time over the steps after --warmup (mean beside it);
  MFU       titan_models.flops_per_token (6 x matmul parameters + softmax attention + the Gated DeltaNet
            chunked form's matmuls) x tok/s over the GPU's dense bf16 peak (titan_train.metrics);
  peak GiB  torch.cuda.max_memory_allocated over the variant's run;
  vs hf     tok/s over hf's at the same shape;
  loss      first step -> mean of the last 3; gap: the largest relative loss gap to hf over the first
            --loss-steps steps, MISMATCH beyond --loss-rtol (bf16: 0.02; --tiny, fp32, every step: 1e-5),
            and the script exits 1 (--tiny on 2026-12-02, its 4 steps: 1.9e-7 under torch 2.14, 9.4e-8 under
            2.11; a control with transformers' lr 10% higher: 2.8e-2, MISMATCH).
Estimate on an H200 (not measured: no GPU run was made while writing this; the wall s column gives the
real split): ~10 s to init and save the 1B; 30-70 s for titan at 4 x 4096 (the Triton kernels' first
compilation and autotuning, then 20 steps of ~0.4 s); ~15 s for titan at 2 x 4096; 30-60 s for hf at 2 x
4096 (its per-chunk Python loop: 64 chunks x 12 layers, forward and backward); 2-3 minutes in all, under 4.
--tiny: ~1 minute of CPU time (the interpreted kernels), 3-4 minutes on the shared 2-core machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the kernels' CPU check: before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_anchor import adamw, loss_gap, train_steps  # noqa: E402
from variant_run import measured, save_seed0_init, train_titan  # noqa: E402

RECIPE = "qwen3_5_debug"
WARMUP_STEPS = 3  # the lr warm-up, both sides


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    batch: int
    variants: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.layers}L {self.batch}x"


def model_config(args, layers: int):
    """The benchmarked Qwen3.5 (module docstring) on `layers` layers, or the debug flavor under --tiny."""
    import titan_models as tm

    if args.tiny:
        return dataclasses.replace(tm.flavor("qwen3_5", "debug"), vocab_size=384)  # the recipe's vocabulary
    base = tm.flavor("qwen3_5", "35B-A3B")  # hidden 2048, its attention and Gated DeltaNet heads
    return dataclasses.replace(base, moe=None, ffn_dim=args.ffn, vocab_size=args.vocab, num_layers=layers,
                               layer_types=None, full_attention_interval=4, max_seq_len=args.seq)


def save_initial_weights(args, layers: int, folder: Path) -> tuple[int, float]:
    """titan-models' init (seed 0) as a Hugging Face folder in the training dtype; (parameters, FLOPs/token)."""
    return save_seed0_init(model_config(args, layers), folder, device=args.device, dtype=args.dtype, seq=args.seq)


def titan_config(args, shape: Shape, job: Path, folder: Path):
    """The recipe qwen3_5_debug on the folder's weights, as this benchmark runs it."""
    from titan_train import load_recipe
    from titan_train.cli_args import apply_override

    run = load_recipe(RECIPE)
    gpu = args.device == "cuda"
    overrides = {
        "job.device": args.device, "job.folder": str(job), "job.seed": "0", "model.hf_path": str(folder),
        "data.source": args.data, "data.document_masking": "false",
        "training.steps": str(args.steps), "training.batch_size": str(shape.batch), "training.seq_len": str(args.seq),
        "training.mixed_precision": "bf16_params" if gpu else "fp32",
        "optimizer.lr": str(args.lr),  # bf16_params' AdamW is titan-train's fused master-weight kernel
        "activation_checkpoint.mode": "none", "compile.enabled": "false",
        "lr_schedule.kind": "constant", "lr_schedule.warmup_steps": str(WARMUP_STEPS),
        "checkpoint.interval": "0", "checkpoint.resume": "false", "metrics.tensorboard": "false",
        "metrics.progress": "false", "metrics.log_interval": "1",  # every step synchronised, as hf's
    }
    for field_name, value in overrides.items():
        apply_override(run, field_name, value)
    return run


def run_titan(args, shape: Shape, folder: Path) -> dict:
    out = train_titan(lambda job: titan_config(args, shape, job, folder))
    del out["records"]
    return out


def hf_batches(args, shape: Shape, vocab: int):
    """The Trainer's batches (data.source args.data, job.seed 0) as transformers' keyword arguments."""
    if args.data == "random":
        from titan_train.data import random_rows

        for step in range(args.steps):
            window = random_rows(vocab, args.seq, seed=0, first_row=step * shape.batch, rows=shape.batch)
            labels = window[:, 1:].contiguous()
            yield {"input_ids": window[:, :-1].contiguous(), "labels": labels, "shift_labels": labels}
        return
    from titan_train.data import ByteTokenizer, PackedLoader, open_documents

    loader = PackedLoader(open_documents("stdlib"), ByteTokenizer(), seq_len=args.seq, seed=0, document_masking=False)
    for _ in range(args.steps):
        batch = loader.next_batch(shape.batch)
        yield {"input_ids": batch.tokens, "labels": batch.labels, "shift_labels": batch.labels}


def run_hf(args, shape: Shape, folder: Path) -> dict:
    import transformers
    from titan_train import load_recipe

    model = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=args.dtype,
                                                            attn_implementation="sdpa").to(args.device)
    model.train()
    recipe = load_recipe(RECIPE)
    o, device = recipe.optimizer, torch.device(args.device)
    optimizer = adamw(model, lr=args.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                      device=device)
    out = train_steps(model, optimizer, hf_batches(args, shape, model.config.vocab_size), steps=args.steps,
                      warmup=WARMUP_STEPS, clip=recipe.training.max_grad_norm, device=device, label="hf")
    del model, optimizer
    return out


def run_variant(args, shape: Shape, folder: Path, variant: str) -> dict:
    """One variant's figures, or {"error": ...} when it failed (the other variants still run)."""
    print(f"--- qwen3_5 {shape.name}{args.seq} {variant}", flush=True)
    run = (lambda: run_titan(args, shape, folder)) if variant == "titan" else (lambda: run_hf(args, shape, folder))
    return measured(run, device=args.device, warmup=args.warmup, tokens_per_step=shape.batch * args.seq)


def measure(args, shapes: list[Shape]) -> list[dict]:
    """Every shape's variants; shapes with the same layer count share one saved initial-weights folder."""
    rows = []
    for layers in dict.fromkeys(s.layers for s in shapes):
        with tempfile.TemporaryDirectory(prefix="qwen3_5_init_") as tmp:
            began = time.perf_counter()
            params, flops = save_initial_weights(args, layers, Path(tmp))
            print(f"--- qwen3_5 {layers} layers: {params / 1e9:.3f}B parameters, {flops / 1e9:.2f} GFLOP/token at "
                  f"{args.seq}; initial weights saved in {time.perf_counter() - began:.1f} s", flush=True)
            for shape in (s for s in shapes if s.layers == layers):
                rows.append({"shape": dataclasses.asdict(shape), "name": shape.name, "params": params,
                             "flops_per_token": flops,
                             "variants": {v: run_variant(args, shape, Path(tmp), v) for v in shape.variants}})
    return rows


def check_rows(args, rows: list[dict]) -> list[str]:
    """Each variant's ratio to hf at its shape and loss gap to hf (set in place); the problems found."""
    problems = []
    for row in rows:
        ok = {v: r for v, r in row["variants"].items() if "error" not in r}
        reference = ok.get("hf")
        for variant, r in ok.items():
            r["vs_hf"] = r["tokens_per_s"] / reference["tokens_per_s"] if reference else None
            r["loss_gap"] = None
            if reference is not None and r is not reference:
                r["loss_gap"] = loss_gap(r["losses"], reference["losses"], steps=args.loss_steps)
                if r["loss_gap"] > args.loss_rtol:
                    problems.append(f"{row['name']} {variant}: loss MISMATCH against hf ({r['loss_gap']:.2e})")
            if args.data == "stdlib" and not r["last_loss"] < r["first_loss"]:
                problems.append(f"{row['name']} {variant}: the loss did not fall")
    return problems


def print_table(args, rows: list[dict], device: str, peak: float | None) -> None:
    print(f"\nQwen3.5 dense training, {args.seq} tokens per row, data {args.data}, {device}, torch "
          f"{torch.__version__}; medians (means) of steps {args.warmup + 1}-{args.steps}; vs hf: tok/s over hf's at "
          f"the same shape; gap: max relative loss gap to hf over steps 1-{args.loss_steps}")
    print("| layers | batch | params | variant | tok/s | step s median (mean) | MFU | peak GiB | vs hf | "
          "loss first -> last 3 | gap | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        size = f"{row['params'] / 1e9:.2f}B" if row["params"] >= 1e8 else f"{row['params'] / 1e6:.1f}M"
        head = f"| {row['shape']['layers']} | {row['shape']['batch']} | {size}"
        for variant, r in row["variants"].items():
            if "error" in r:
                print(f"{head} | {variant} | error: {r['error']} |  |  |  |  |  |  | {r['wall_s']:.0f} |")
                continue
            mfu = f"{100 * row['flops_per_token'] * r['tokens_per_s'] / peak:.1f}%" if peak else "n/a"
            mem = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
            ratio = f"{r['vs_hf']:.2f}" if r["vs_hf"] is not None else "no anchor at this shape"
            gap = "" if r["loss_gap"] is None else \
                f"{r['loss_gap']:.1e} {'ok' if r['loss_gap'] <= args.loss_rtol else 'MISMATCH'}"
            print(f"{head} | {variant} | {r['tokens_per_s']:.0f} | {r['step_median_s']:.3f} ({r['step_mean_s']:.3f}) "
                  f"| {mfu} | {mem} | {ratio} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | {gap} | "
                  f"{r['wall_s']:.0f} |")
    for row in rows:
        ok = {v: r for v, r in row["variants"].items() if "error" not in r}
        if "titan" in ok and "hf" in ok:
            print(f"{row['name']}{args.seq}: titan {ok['titan']['vs_hf']:.2f}x transformers' tok/s at the same shape"
                  + (" (CPU, interpreted kernels: a check of the script, not a measurement)" if args.tiny else ""))


def shapes(args) -> list[Shape]:
    """The main shape (titan, and hf when the anchor shape is the same) and, when it differs, the anchor's."""
    anchor = Shape(args.anchor_layers or args.layers, args.anchor_batch or args.batch, tuple(args.variants))
    main = Shape(args.layers, args.batch, tuple(args.variants))
    if anchor == main or "hf" not in args.variants:
        return [main]
    print(f"the anchor runs at {anchor.layers} layers x {anchor.batch} x {args.seq} (not the main "
          f"{main.layers} x {main.batch} x {args.seq}: transformers' torch fallback of the delta rule keeps ~0.5 GiB "
          f"per 1024 tokens per layer); titan runs both, and the ratio compares that shape only", flush=True)
    return [Shape(main.layers, main.batch, ("titan",)), anchor]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --tiny: exact
    parser.add_argument("--tiny", action="store_true",
                        help="the debug flavor on CPU in fp32 (Triton kernels interpreted), titan and hf, checks "
                             "that their losses agree")
    parser.add_argument("--layers", type=int, default=16, help="layers (3 Gated DeltaNet : 1 attention)")
    parser.add_argument("--batch", type=int, default=4, help="rows per step of titan's main run")
    parser.add_argument("--anchor-layers", type=int, default=0, help="layers of the hf comparison (0: --layers)")
    parser.add_argument("--anchor-batch", type=int, default=2, help="rows of the hf comparison (0: --batch)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per row")
    parser.add_argument("--ffn", type=int, default=4096, help="SwiGLU width")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary (the byte tokenizer uses 260 ids)")
    parser.add_argument("--variants", default="titan,hf", help="comma-separated, of titan, hf")
    parser.add_argument("--data", default="stdlib", choices=("stdlib", "random"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--loss-steps", type=int, default=4, help="first steps whose losses are compared with hf's")
    parser.add_argument("--loss-rtol", type=float, default=None,
                        help="allowed relative loss gap to hf (default 0.02 in bf16, 1e-5 for --tiny in fp32)")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - {"titan", "hf"})
    if unknown:
        sys.exit(f"unknown variants {unknown}: choose from titan, hf")
    args.device, args.dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    if args.tiny:
        args.layers, args.batch, args.anchor_layers, args.anchor_batch = 4, 2, 0, 0
        args.seq, args.steps, args.warmup, args.lr = 128, 4, 1, 2e-3  # > 64 tokens: two delta-rule chunks
        args.loss_steps = args.steps
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU check)")
    if args.loss_rtol is None:
        args.loss_rtol = 1e-5 if args.tiny else 0.02
    if not 0 <= args.warmup < args.steps:
        sys.exit(f"--warmup must be in [0, --steps); got {args.warmup} with --steps {args.steps}")
    return args


def titan_delta_rule(args) -> str:
    """Which form titan-models' layers take at this shape (the layer's own decision, on probe tensors)."""
    from titan_models.kernels.gated_delta_rule import interpreting, use_triton

    cfg = model_config(args, args.layers)
    q = torch.empty(1, 1, 1, cfg.linear_key_head_dim, device=args.device, dtype=args.dtype)
    v = torch.empty(1, 1, 1, cfg.linear_value_head_dim, device=args.device, dtype=args.dtype)
    if not use_triton("auto", q, v, torch.empty(1, 1, 1, device=args.device), cfg.linear_chunk_size):
        return "its torch form"
    return "Triton kernels" + (" (interpreted)" if interpreting() else "")


def main() -> None:
    args = parse_args()
    import transformers
    from titan_train.metrics import peak_flops

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    found = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}; titan's delta rule: "
          f"{titan_delta_rule(args)}; transformers' delta rule: "
          f"{'flash-linear-attention' if found['fla'] else 'its torch form'}, short conv: "
          f"{'causal-conv1d' if found['causal_conv1d'] else 'its torch form'}", flush=True)
    began = time.perf_counter()
    rows = measure(args, shapes(args))
    problems = check_rows(args, rows)
    print_table(args, rows, device, peak_flops(torch.device(args.device)))
    summary = json.dumps({"bench": "qwen3_5_train", "device": device, "torch": torch.__version__,
                          "transformers": transformers.__version__, "seq": args.seq, "steps": args.steps,
                          "data": args.data, "wall_s": time.perf_counter() - began, "rows": rows})
    print(summary)
    if os.environ.get("OUT"):  # the device machine brings $OUT back
        Path(os.environ["OUT"], "qwen35_train.json").write_text(summary)
    if problems:
        sys.exit("\n".join(problems))


if __name__ == "__main__":
    main()
