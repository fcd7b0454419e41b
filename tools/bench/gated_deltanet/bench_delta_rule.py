"""Gated DeltaNet's chunked delta rule: titan-models' torch form against transformers' torch form (the
anchor) and, when installed, flash-linear-attention's Triton kernel (`fla-core`), at one layer's shapes.

Self-checking: at the benchmark shapes every implementation's output is compared with titan-models'
chunked form run in float64 (relative error printed); then each is timed, forward and
forward + backward, as the median of `--repeats` runs after a warm-up, and printed with its ratio to
transformers' time measured in the same run (> 1: faster than the anchor).

Default shapes: Qwen3.5-35B-A3B's linear-attention layer (32 value heads of 128, key heads repeated
to 32, key dim 128), batch 1, sequence 4096. `--per-channel`: Kimi Delta Attention's decay (one per key
channel; Kimi-Linear-48B-A3B has the same 32 heads of 128), against transformers' `chunk_kimi_delta_attention`
and flash-linear-attention's `chunk_kda`.

CPU (smoke):  uv run --frozen --no-sync python tools/bench/gated_deltanet/bench_delta_rule.py --seq 256 --heads 4
GPU:          uv run --frozen --no-sync python tools/bench/gated_deltanet/bench_delta_rule.py --device cuda \
                  --seq 4096   (and --seq 32768; fla-core's wheel installed beside it for its column;
                  add --per-channel for Kimi Delta Attention)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from titan_models.components.gated_deltanet import chunked_delta_rule, l2_normalize


def inputs(args, dtype):
    gen = torch.Generator(device=args.device).manual_seed(0)
    shape = (args.batch, args.seq, args.heads)
    q, k = (torch.randn(*shape, args.dk, device=args.device, generator=gen) for _ in range(2))
    v = torch.randn(*shape, args.dv, device=args.device, generator=gen)
    g = -F.softplus(torch.randn(*shape, *([args.dk] if args.per_channel else []), device=args.device, generator=gen))
    beta = torch.rand(*shape, device=args.device, generator=gen)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def implementations(args):
    """name -> fn(q, k, v, g, beta) -> out, taking raw q/k (each normalises them)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def ours(q, k, v, g, beta):
        return chunked_delta_rule(l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), v, g, beta)[0]

    if args.per_channel:
        return per_channel_implementations(ours)
    impls = {"transformers (torch)": lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0], "titan-models (torch)": ours}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        impls["flash-linear-attention"] = lambda q, k, v, g, beta: chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    except ImportError:
        print("flash-linear-attention not installed: its column is left out")
    return impls


def per_channel_implementations(ours):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    impls = {"transformers (torch)": lambda q, k, v, g, beta: chunk_kimi_delta_attention(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0], "titan-models (torch)": ours}
    try:
        from fla.ops.kda import chunk_kda

        impls["flash-linear-attention"] = lambda q, k, v, g, beta: chunk_kda(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    except ImportError:
        print("flash-linear-attention not installed: its column is left out")
    return impls


def timed(fn, args, *, backward: bool) -> float:
    tensors = [t.detach().requires_grad_(backward) for t in inputs(args, torch.float32)]

    def step():
        out = fn(*tensors)
        if backward:
            out.float().square().mean().backward()

    for _ in range(2):
        step()
    times = []
    for _ in range(args.repeats):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per-channel", action="store_true", help="Kimi Delta Attention: one decay per key channel")
    args = parser.parse_args()
    impls = implementations(args)
    # titan-models' chunked form in float64 (tests/test_gated_deltanet.py holds it to a float64 recurrence)
    reference = impls["titan-models (torch)"](*inputs(args, torch.float64)).double()
    rows = []
    for name, fn in impls.items():
        with torch.no_grad():
            err = ((fn(*inputs(args, torch.float32)).double() - reference).norm() / reference.norm()).item()
        rows.append((name, err, timed(fn, args, backward=False), timed(fn, args, backward=True)))
    anchor = rows[0]
    print(f"{'per-channel (KDA)' if args.per_channel else 'per-head'} delta rule, batch {args.batch}, seq {args.seq}, {args.heads} heads, dk {args.dk}, dv {args.dv}, "
          f"{args.device}, float32 inputs")
    print(f"{'implementation':24s} {'rel err vs fp64':>16s} {'fwd ms':>9s} {'x anchor':>9s} {'fwd+bwd ms':>11s} "
          f"{'x anchor':>9s}")
    for name, err, fwd, both in rows:
        print(f"{name:24s} {err:16.2e} {fwd:9.2f} {anchor[2] / fwd:9.3f} {both:11.2f} {anchor[3] / both:9.3f}")


if __name__ == "__main__":
    main()
