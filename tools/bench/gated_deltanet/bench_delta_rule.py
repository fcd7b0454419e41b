"""Gated DeltaNet's chunked delta rule at one layer's shapes: titan-models' Triton kernels and torch form
against transformers' torch form (the anchor) and, when installed, flash-linear-attention's Triton kernel
(`fla-core` 0.6, imported only here: never in the test environment).

Self-checking: every implementation's output is compared with titan-models' chunked form run in float64 on
the same (rounded) inputs (relative error printed); then each is timed, forward and forward + backward, as
the median of `--repeats` steady-state runs (after `--warmup` runs, which also take the kernels' first-call
autotuning), and printed with its ratio to transformers' time and to flash-linear-attention's, both
measured in the same run (> 1: faster than that one).

Default shapes: Qwen3.5-35B-A3B's linear-attention layer (Qwen3-Next-80B-A3B has the same: 32 value heads
of 128, its 16 key heads of 128 repeated to 32), batch 1, sequence 4096. `--documents N` packs N equal
documents into the row (titan-models' segments, fla's cu_seqlens; transformers' torch form has no document
resets, so it runs the row unpacked and its error column is left out). `--per-channel`: Kimi Delta
Attention's decay (one per key channel; Kimi-Linear-48B-A3B has the same 32 heads of 128), against
transformers' `chunk_kimi_delta_attention` and flash-linear-attention's `chunk_kda`; titan-models' Triton
kernels take one decay per head, so they have no column there.

CPU (smoke; the Triton kernels run through TRITON_INTERPRET=1, which this script sets on CPU, in float32):
    uv run --frozen --no-sync python tools/bench/gated_deltanet/bench_delta_rule.py --seq 128 --heads 2 \
        --dk 16 --dv 16 --repeats 1 --warmup 0
GPU (fla-core's wheel installed beside it for its column):
    python tools/bench/gated_deltanet/bench_delta_rule.py --device cuda --dtype bfloat16 --seq 4096
    (and --seq 32768; --documents 8; --dtype float32: the kernels' tf32x3 path; --per-channel;
    --forward-kernels: each Triton forward's kernels timed one by one through torch.profiler, no table)
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import torch
import torch.nn.functional as F

from titan_models.components.gated_deltanet import chunked_delta_rule, l2_normalize
from titan_models.kernels.gated_delta_rule import triton_chunked_delta_rule


def inputs(args, dtype):
    gen = torch.Generator(device=args.device).manual_seed(0)
    shape = (args.batch, args.seq, args.heads)
    q, k = (torch.randn(*shape, args.dk, device=args.device, generator=gen) for _ in range(2))
    v = torch.randn(*shape, args.dv, device=args.device, generator=gen)
    g = -F.softplus(torch.randn(*shape, *([args.dk] if args.per_channel else []), device=args.device, generator=gen))
    beta = torch.rand(*shape, device=args.device, generator=gen)
    return [t.to(dtype) for t in (q, k, v)] + [g, beta]  # gates float32, as the layer gives them


def documents(args):
    """(segments [b, s], cu_seqlens [docs + 1]) for --documents equal documents per row, or (None, None)."""
    if args.documents <= 1:
        return None, None
    ids = torch.arange(args.seq, device=args.device) * args.documents // args.seq
    starts = torch.arange(args.documents + 1, device=args.device) * args.seq // args.documents
    cu = torch.cat([starts[:-1] + row * args.seq for row in range(args.batch)] + [starts[-1:] * args.batch])
    return ids[None].expand(args.batch, -1), cu.long()


def implementations(args):
    """name -> fn(q, k, v, g, beta) -> out, taking raw q/k (each normalises them)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    # transformers' hub-kernel decorator swaps in fla's kernel whenever fla is importable (the H200 run of
    # 2026-12-02 timed fla twice that way); the undecorated function is its torch form, the anchor.
    torch_chunk_gated_delta_rule = inspect.unwrap(torch_chunk_gated_delta_rule)
    segments, cu_seqlens = documents(args)

    def normalised(q, k):  # as the layer gives them: float32 norm, back to the input dtype
        return (l2_normalize(q) * q.shape[-1] ** -0.5).to(q.dtype), l2_normalize(k).to(k.dtype)

    def ours(q, k, v, g, beta):
        return chunked_delta_rule(*normalised(q, k), v, g, beta, segments=segments)[0]

    if args.per_channel:
        return per_channel_implementations(ours)
    impls = {"transformers (torch)": lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0], "titan-models (torch)": ours,
        "titan-models (triton)": lambda q, k, v, g, beta: triton_chunked_delta_rule(
            *normalised(q, k), v, g, beta, segments=segments)[0]}
    if args.dtype == torch.bfloat16:  # the bf16 forward's cost in accuracy and its gain in time, in one run
        impls["titan-models (triton, tf32 fwd)"] = lambda q, k, v, g, beta: triton_chunked_delta_rule(
            *normalised(q, k), v, g, beta, segments=segments, bf16_forward=False)[0]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        print("flash-linear-attention not installed: its column is left out")
        return impls

    def fla(q, k, v, g, beta):
        flat = (lambda t: t.flatten(0, 1)[None]) if cu_seqlens is not None else (lambda t: t)
        out = chunk_gated_delta_rule(*(flat(t) for t in (q, k, v, g, beta)), cu_seqlens=cu_seqlens,
                                     use_qk_l2norm_in_kernel=True)[0]
        return out.view(args.batch, args.seq, *out.shape[2:])

    impls["flash-linear-attention"] = fla
    return impls


def per_channel_implementations(ours):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    chunk_kimi_delta_attention = inspect.unwrap(chunk_kimi_delta_attention)  # its torch form, not fla's kernel

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
    tensors = [t.detach().requires_grad_(backward) for t in inputs(args, args.dtype)]

    def step():
        out = fn(*tensors)
        if backward:
            out.float().square().mean().backward()

    for _ in range(args.warmup):
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


def timed_unless_refused(name: str, fn, args) -> float:
    """Forward + backward time, or NaN where the implementation refuses this machine's stack: fla-core 0.6
    raises in its backward on Hopper with triton >= 3.4, < 3.7.1 (its issue #640: wrong gradients), so the H200
    image's triton 3.6 gets fla's forward column only."""
    try:
        return timed(fn, args, backward=True)
    except RuntimeError as error:
        print(f"{name}: fwd+bwd refused here: {str(error).splitlines()[0]}")
        return float("nan")


def forward_kernel_report(impls, args) -> None:
    """`--forward-kernels`: titan-models' Triton forward and fla's (when installed), per kernel."""
    from forward_kernels import kernel_times, print_kernel_times

    if args.device != "cuda":
        raise ValueError("--forward-kernels needs --device cuda (the profiler times CUDA kernels)")
    tensors = inputs(args, args.dtype)
    for name in ("titan-models (triton)", "titan-models (triton, tf32 fwd)", "flash-linear-attention"):
        if name in impls:
            print_kernel_times(name, kernel_times(impls[name], tensors, warmup=max(args.warmup, 1),
                                                  repeats=args.repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="q, k, v dtype")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--documents", type=int, default=1, help="equal documents packed per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--per-channel", action="store_true", help="Kimi Delta Attention: one decay per key channel")
    parser.add_argument("--forward-kernels", action="store_true",
                        help="instead of the table: each Triton implementation's forward, kernel by kernel (CUDA)")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        if args.dtype != torch.float32:
            raise ValueError("--dtype bfloat16 needs --device cuda (bf16 tl.dot is wrong in Triton's interpreter)")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (by the kernels' first call)
    impls = implementations(args)
    if args.forward_kernels:
        return forward_kernel_report(impls, args)
    # titan-models' chunked form in float64 (tests/test_gated_deltanet.py holds it to a float64 recurrence)
    reference = impls["titan-models (torch)"](*(t.double() for t in inputs(args, args.dtype))).double()
    print(f"{'per-channel (KDA)' if args.per_channel else 'per-head'} delta rule, batch {args.batch}, seq {args.seq}, "
          f"{args.documents} document(s) per row, {args.heads} heads, dk {args.dk}, dv {args.dv}, {args.device}, "
          f"{str(args.dtype).removeprefix('torch.')} q/k/v, median of {args.repeats}")
    rows = []
    for name, fn in impls.items():  # each row printed as it ends: a run cut by a time limit keeps what ended
        err = float("nan")
        if not (name == "transformers (torch)" and args.documents > 1):  # it has no document resets
            with torch.no_grad():
                err = ((fn(*inputs(args, args.dtype)).double() - reference).norm() / reference.norm()).item()
        start = time.perf_counter()
        rows.append((name, err, timed(fn, args, backward=False), timed_unless_refused(name, fn, args)))
        print(f"  {name}: rel err {err:.2e}, fwd {rows[-1][2]:.2f} ms, fwd+bwd {rows[-1][3]:.2f} ms "
              f"({time.perf_counter() - start:.1f} s with warm-up)", flush=True)
    anchor = rows[0]
    fla = next((row for row in rows if row[0] == "flash-linear-attention"), None)
    print(f"{'implementation':24s} {'rel err vs fp64':>16s} {'fwd ms':>9s} {'x anchor':>9s} {'x fla':>7s} "
          f"{'fwd+bwd ms':>11s} {'x anchor':>9s} {'x fla':>7s}")
    for name, err, fwd, both in rows:
        vs_fla = (f"{fla[2] / fwd:7.3f}", f"{fla[3] / both:7.3f}") if fla else ("      -", "      -")
        print(f"{name:24s} {err:16.2e} {fwd:9.2f} {anchor[2] / fwd:9.3f} {vs_fla[0]} {both:11.2f} "
              f"{anchor[3] / both:9.3f} {vs_fla[1]}")

if __name__ == "__main__":
    main()
