"""titan-train against Hugging Face transformers: training tokens/s on one GPU, same model, data and weights.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/train_throughput/bench.py
    (CPU check of the script:  ... bench.py --tiny --device cpu)

The model is the Llama 3 "1.5B" configuration (hidden 2048, 16 layers, 32 query / 8 key-value heads,
FFN 8192, vocabulary 128,256, untied embeddings, RoPE theta 500k). transformers builds it with SDPA
attention and saves it; titan-train starts from that folder (`--model.hf_path`), so both runs begin
from the same weights, and both read the same tokens: `--data stdlib` (default) packs Python's standard library sources with
titan-train's byte tokenizer and loader (no document masking on either side), so the loss gap is
checked on real text; `--data random` uses uniform random tokens (where every model sits at ln V). Both train in bf16 with AdamW (lr 3e-4, betas 0.9/0.95, weight
decay 0.1 on matrices, clip 1.0, 10 warm-up steps then constant); transformers keeps bf16 weights and moments, titan-train fp32 ones:
  hf             transformers LlamaForCausalLM, bf16 weights, its own loss, fused AdamW;
  hf_compile     the same with torch.compile(model);
  hf_liger       the same after liger-kernel's apply_liger_kernel_to_llama (RoPE, RMSNorm, SwiGLU, fused
                 linear cross-entropy): the strongest transformers anchor measured so far (issue 26), so the
                 ratio column is against the fastest hf* variant of the run;
  titan_compile  titan-train's Trainer: every block compiled, bf16 parameters with fp32 master weights and
                 moments in the optimizer (--training.mixed_precision bf16_params), the Triton kernels
                 (SwiGLU backward, loss chunk, AdamW), the fused chunked loss;
  titan          the same without compile;
  titan_compile_autocast       compiled, fp32 parameters under bf16 autocast (--training.mixed_precision bf16);
  titan_compile_torch_kernels  compiled, bf16_params, without the Triton SwiGLU/loss kernels;
  titan_compile_sac            titan_compile with op-level selective checkpointing compiled into each block
                               (--activation_checkpoint.mode selective: the block keeps its input, the q/k/v,
                               attention and output projections and gate|up; norms, RoPE and SwiGLU recompute);
  titan_compile_sac_bf16_moments  the same with AdamW's moments in bf16 (--optimizer.moment_dtype bfloat16;
                               the master weights stay fp32);
  titan_compile_lean           the same with 2048-token loss chunks summing the output weight's gradient in
                               bf16 (--training.loss_chunk_size 2048 --training.loss_weight_grad_dtype param):
                               the best memory setting.
A titan variant's name with the suffix _cudnn runs it with SDPA's cuDNN attention tried first.
--size 8B runs the Llama 3 8B shapes (hidden 4096, 32 layers, FFN 14,336) instead of the 1.5B ones.
memory_model.py counts where each variant's peak goes; the table prints that count ('exp GiB') beside the
measured peak.
The matmul rate and copy bandwidth are measured in the same run. MFU uses FLOPs/token =
6 N + 6 L d s (N: parameters a token multiplies with, output projection included, input embedding
excluded; attention counted causal), the convention of the issue's 40% figure for transformers.
The first steps' losses of every variant are compared with transformers' (bf16 tolerance).
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from hf_anchor import adamw, loss_gap, sync, train_steps  # noqa: E402

SIZES = {  # name: (hidden, layers, heads, kv_heads, ffn, vocab)
    "1.5B": (2048, 16, 32, 8, 8192, 128256),
    "8B": (4096, 32, 32, 8, 14336, 128256),
    "tiny": (128, 2, 4, 2, 256, 1024),
}
LR, BETAS, WEIGHT_DECAY, EPS, CLIP = 3e-4, (0.9, 0.95), 0.1, 1e-8, 1.0
# Linear warm-up to LR, then constant, on both sides: without it the first steps on real text spike
# (loss 8.7 -> 15 at step 3) and any rounding difference sends the runs apart, hiding real mismatches.
WARMUP = 10
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch: checks the script on CPU")
    p.add_argument("--size", default="1.5B", choices=("1.5B", "8B"), help="the Llama shapes (--tiny overrides)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30, help="steps per variant, warm-up included")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the timing")
    p.add_argument("--variants", default="hf,hf_compile,hf_liger,titan_compile")
    p.add_argument("--data", default="stdlib", choices=("stdlib", "random"),
                   help="stdlib: real text (byte tokens) for both; random: uniform random tokens")
    p.add_argument("--titan-args", default="",
                   help="extra titan-train CLI overrides for the titan variants (after, so over, the variant's own)")
    p.add_argument("--profile", default="", help="a titan variant to profile for two more steps after its run")
    p.add_argument("--loss-rtol", type=float, default=0.02, help="allowed relative loss gap to transformers")
    return p.parse_args()


def measure_rates(device: torch.device) -> tuple[float | None, float | None]:
    """(bf16 matmul FLOP/s on 8192^3 random data, device copy bytes/s read+written) on CUDA."""
    if device.type != "cuda":
        return None, None
    from triton.testing import do_bench

    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    matmul = 2 * 8192**3 / (ms * 1e-3)
    src = torch.randn(2**30 // 2, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    copy = 2 * src.numel() * 2 / (ms * 1e-3)
    del a, b, src, dst
    return matmul, copy


def hf_config(size: str):
    import transformers

    hidden, layers, heads, kv_heads, ffn, vocab = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa")


def flops_per_token(size: str, seq: int) -> float:
    hidden, layers, heads, kv_heads, ffn, vocab = SIZES[size]
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * ffn
    n = layers * per_layer + vocab * hidden  # + output projection; input embedding excluded
    return 6 * n + 6 * layers * hidden * seq


def batches(vocab: int, seq: int, batch: int, steps: int, data: str):
    """The batches titan-train reads with `--data.source {data}` and job seed 0: (tokens, labels) per step."""
    if data == "random":
        from titan_train.data import random_rows

        for step in range(steps):
            window = random_rows(vocab, seq, seed=0, first_row=step * batch, rows=batch)
            yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
        return
    from titan_train.data import ByteTokenizer, PackedLoader, open_documents

    loader = PackedLoader(open_documents("stdlib"), ByteTokenizer(), seq_len=seq, seed=0, document_masking=False)
    for _ in range(steps):
        b = loader.next_batch(batch)
        yield b.tokens, b.labels


def titan_data_flags(data: str) -> list[str]:
    if data == "random":
        return ["--data.source", "random"]
    return ["--data.source", "stdlib", "--data.tokenizer", "byte", "--data.document_masking", "false"]


def build_hf_model(folder: Path, variant: str, device: torch.device):
    """transformers' Llama as a strong user would run it: eager, compiled, or with liger-kernel's kernels."""
    import transformers

    if variant == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Patches the Llama modules' classes (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) before building.
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    model.train()
    if variant == "hf_compile":
        model = torch.compile(model)
    return model


def run_hf(folder: Path, args, device: torch.device, variant: str = "hf") -> dict:
    model = build_hf_model(folder, variant, device)
    optimizer = adamw(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, device=device)
    vocab = SIZES["tiny" if args.tiny else args.size][5]
    inputs = ({"input_ids": tokens, "labels": labels, "shift_labels": labels}
              for tokens, labels in batches(vocab, args.seq, args.batch, args.steps, args.data))
    out = train_steps(model, optimizer, inputs, steps=args.steps, warmup=WARMUP, clip=CLIP, device=device,
                      label=variant)
    del model, optimizer
    return out


def sdpa_cudnn_first():
    """SDPA with cuDNN's attention preferred over FlashAttention-2 (both allowed, cuDNN tried first)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch without set_priority: cuDNN is then one of the allowed backends
        return sdpa_kernel(order)


def profile_steps(trainer, device: torch.device, steps: int = 2) -> None:
    """Where one trained step's GPU time goes: the kernels with the most total time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for i in range(steps):
            trainer.train_step(10_000 + i)
        sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=28, max_name_column_width=70), flush=True)
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="titan_trace_")
    trace = Path(out_dir, "trace.json")
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:  # 16 MiB per file comes back
        dst.write(src.read())
    trace.unlink()
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_gaps import report

    print(report(Path(f"{trace}.gz")), flush=True)


def run_titan(folder: Path, args, device: torch.device, *, compile_blocks: bool, profile: bool = False,
              extra: tuple[str, ...] = ()) -> dict:
    from titan_train.cli import parse_args as parse_train_args
    from titan_train.trainer import Trainer

    job = Path(tempfile.mkdtemp(prefix="titan_bench_"))
    cli = [
        "--model.hf_path", str(folder), *titan_data_flags(args.data), "--job.device", device.type,
        "--job.folder", str(job), "--training.steps", str(args.steps), "--training.batch_size", str(args.batch),
        "--training.seq_len", str(args.seq), "--training.max_grad_norm", str(CLIP),
        "--optimizer.lr", str(LR), "--optimizer.beta1", str(BETAS[0]),
        "--optimizer.beta2", str(BETAS[1]), "--optimizer.weight_decay", str(WEIGHT_DECAY),
        "--optimizer.eps", str(EPS), "--lr_schedule.kind", "constant", "--lr_schedule.warmup_steps", str(WARMUP),
        "--checkpoint.interval", "0", "--checkpoint.resume", "false", "--metrics.tensorboard", "false",
        "--metrics.progress", "false", "--compile.enabled", "true" if compile_blocks else "false",
        *extra, *args.titan_args.split(),  # --titan-args last: they override a variant's own flags
    ]
    config, _ = parse_train_args(cli)
    trainer = Trainer(config, device)
    trainer.run()
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        print(f"  titan step {r['step']}: loss {r['loss']:.4f}  {r['step_seconds'] * 1e3:.0f} ms", flush=True)
    if profile:
        profile_steps(trainer, device)
    del trainer
    return {"losses": [r["loss"] for r in records], "seconds": [r["step_seconds"] for r in records]}


HF_VARIANTS = ("hf", "hf_compile", "hf_liger")
# name: (compile the blocks, extra titan-train flags); the first is titan-train as the README recommends.
TITAN_VARIANTS = {
    "titan_compile": (True, ("--training.mixed_precision", "bf16_params")),
    "titan": (False, ("--training.mixed_precision", "bf16_params")),
    "titan_compile_autocast": (True, ("--training.mixed_precision", "bf16")),
    "titan_compile_torch_kernels": (True, ("--training.mixed_precision", "bf16_params",
                                           "--training.fused_kernels", "false")),
}
SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective", "ops")
TITAN_VARIANTS["titan_compile_sac"] = (True, TITAN_VARIANTS["titan_compile"][1] + SAC)
TITAN_VARIANTS["titan_compile_sac_bf16_moments"] = (
    True, TITAN_VARIANTS["titan_compile_sac"][1] + ("--optimizer.moment_dtype", "bfloat16"))
TITAN_VARIANTS["titan_compile_lean"] = (
    True, TITAN_VARIANTS["titan_compile_sac_bf16_moments"][1] + ("--training.loss_chunk_size", "2048",
                                                                 "--training.loss_weight_grad_dtype", "param"))


def run_variant(variant: str, folder: Path, args, device: torch.device) -> dict:
    profile = variant == args.profile
    if variant in HF_VARIANTS:
        return run_hf(folder, args, device, variant)
    base = variant.removesuffix("_cudnn")
    if base not in TITAN_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(HF_VARIANTS)}, {', '.join(TITAN_VARIANTS)}, "
                         "and each titan variant with the suffix _cudnn")
    compile_blocks, extra = TITAN_VARIANTS[base]
    if base != variant:
        with sdpa_cudnn_first():
            return run_titan(folder, args, device, compile_blocks=compile_blocks, profile=profile, extra=extra)
    return run_titan(folder, args, device, compile_blocks=compile_blocks, profile=profile, extra=extra)


def print_table(results: dict, args, *, size: str, fpt: float, matmul: float | None, device: torch.device
                ) -> tuple[str, bool]:
    """The summary table: speed, MFU, measured and counted peak memory, the ratios against the fastest
    transformers variant, the loss gap against transformers eager; then whether a titan variant meets issue
    26's target (1.3x the anchor's tokens/s at no more peak memory). Returns (anchor name, losses ok)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from memory_model import expected_gib

    anchors = [results[v] for v in HF_VARIANTS if v in results]
    anchor = max(anchors, key=lambda r: r["tokens_per_s"]) if anchors else None
    best = next((v for v in HF_VARIANTS if v in results and results[v] is anchor), "none")
    reference = results.get("hf", anchor)  # the eager losses are the numeric reference
    print(f"\ndata {args.data}; ratio against the fastest transformers variant ({best}); loss gap against hf eager"
          " (or the anchor); exp GiB: memory_model.py's count")
    print(f"\n{'variant':<37}{'tokens/s':>10}{'step ms':>9}{'MFU 989':>9}{'MFU meas':>9}{'peak GiB':>9}{'exp GiB':>8}"
          f"{'vs best':>8}{'mem/best':>9}  loss gap (max rel, steps 1-{min(args.steps, 8)})")
    ok, met = True, []
    for name, out in results.items():
        achieved = out["tokens_per_s"] * fpt
        mfu = f"{achieved / PEAK_BF16:9.1%}" if device.type == "cuda" else f"{'n/a':>9}"
        mfu_meas = f"{achieved / matmul:9.1%}" if matmul else f"{'n/a':>9}"
        peak = f"{out['peak_gib']:9.1f}" if out["peak_gib"] is not None else f"{'n/a':>9}"
        counted = expected_gib(name, size, args.batch, args.seq)
        counted = f"{counted:8.1f}" if counted is not None else f"{'n/a':>8}"
        ratio = out["tokens_per_s"] / anchor["tokens_per_s"] if anchor else math.nan
        memory = (out["peak_gib"] / anchor["peak_gib"] if anchor and out["peak_gib"] and anchor["peak_gib"]
                  else math.nan)
        gap = ""
        if reference and out is not reference:
            worst = loss_gap(out["losses"], reference["losses"], steps=8)
            gap = f"{worst:.2e} {'ok' if worst <= args.loss_rtol else 'MISMATCH'}"
            ok &= worst <= args.loss_rtol
        if name.startswith("titan") and ratio >= 1.3 and memory <= 1.0:
            met.append(name)
        print(f"{name:<37}{out['tokens_per_s']:10.0f}{out['step_s'] * 1e3:9.1f}{mfu}{mfu_meas}{peak}{counted}"
              f"{ratio:8.2f}{memory:9.2f}  {gap}")
    print(f"issue 26 target (>= 1.3x {best}'s tokens/s at <= its peak memory): "
          f"{'met by ' + ', '.join(met) if met else 'not met'}")
    return best, ok


def main() -> int:
    args = parse_args()
    size = "tiny" if args.tiny else args.size
    if args.tiny:
        args.batch, args.seq, args.steps, args.warmup = 2, 64, 4, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny to check the script", file=sys.stderr)
        return 2
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    matmul, copy = measure_rates(device)
    if matmul:
        print(f"measured: bf16 matmul {matmul / 1e12:.0f} TFLOP/s (8192^3), copy {copy / 1e9:.0f} GB/s", flush=True)
    fpt = flops_per_token(size, args.seq)
    tokens_per_step = args.batch * args.seq
    results = {}
    with tempfile.TemporaryDirectory(prefix="hf_llama_") as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config(size)).to(torch.bfloat16)
        model.save_pretrained(folder)
        n_params = sum(p.numel() for p in model.parameters())
        del model
        print(f"model: {size} Llama ({n_params / 1e9:.2f}B parameters), batch {args.batch} x {args.seq}, "
              f"{fpt / 1e9:.2f} GFLOP/token", flush=True)
        # liger patches transformers' Llama classes for the rest of the process: run it after the other hf variants.
        variants = sorted(args.variants.split(","), key=lambda v: v == "hf_liger")
        for variant in variants:
            print(f"== {variant}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            began = time.perf_counter()
            try:
                out = run_variant(variant, folder, args, device)
            except Exception as e:  # one failing variant must not cost the others' figures
                import traceback

                traceback.print_exc()
                print(f"== {variant} FAILED: {type(e).__name__}: {e}", flush=True)
                gc.collect()
                torch._dynamo.reset()
                continue
            out["wall_s"] = time.perf_counter() - began
            out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            timed = out["seconds"][args.warmup:]
            out["step_s"] = statistics.median(timed)
            out["tokens_per_s"] = tokens_per_step / out["step_s"]
            results[variant] = out
            gc.collect()
            torch._dynamo.reset()

    best, ok = print_table(results, args, size=size, fpt=fpt, matmul=matmul, device=device)
    summary = {"size": size, "data": args.data, "anchor": best, "batch": args.batch, "seq": args.seq, "flops_per_token": fpt,
               "matmul_flops": matmul, "copy_bytes_s": copy, "torch": torch.__version__, "results": results}
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "train_throughput.json").write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
