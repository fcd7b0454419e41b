"""Gated DeltaNet's chunked delta rule at one layer's shapes: titan-models' Triton kernels and torch form
against transformers' torch form (the anchor) and, when installed, flash-linear-attention's Triton kernel
(`fla-core` 0.6, imported only here: never in the test environment).

Self-checking: every implementation's output is compared with titan-models' chunked form run in float64 on
the same (rounded) inputs (relative error printed); then each is timed, forward and forward + backward, as
the median of `--repeats` steady-state runs (after `--warmup` runs, which also take the kernels' first-call
autotuning), and printed with its ratio to transformers' time and to flash-linear-attention's, both
measured in the same run (> 1: faster than that one). fla is timed first, then titan-models' Triton op
(bf16 and tf32 forwards for bf16 inputs), then transformers' torch form; each line prints as it ends.

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
    --titan-torch: also titan-models' torch form; --forward-kernels / --train-kernels: each Triton form's
    forward / forward + backward kernels timed one by one through torch.profiler, no table)
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


TRITON_BF16 = "titan-models (triton, bf16 fwd)"
TRITON_TF32 = "titan-models (triton, tf32 fwd)"
FLA = "flash-linear-attention"
TRANSFORMERS = "transformers (torch)"


def implementations(args):
    """name -> fn(q, k, v, g, beta) -> out, taking raw q/k (each normalises them: fla and titan-models' Triton
    op in their own kernels, `use_qk_l2norm_in_kernel` / `qk_l2norm`), in the order they are timed: fla
    first (its ~30 s autotune is the likeliest to be cut by a time limit), titan-models' Triton forms,
    then the torch forms."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    # transformers' hub-kernel decorator swaps in fla's kernel whenever fla is importable (the H200 run of
    # 2026-12-02 timed fla twice that way); the undecorated function is its torch form, the anchor.
    torch_chunk_gated_delta_rule = inspect.unwrap(torch_chunk_gated_delta_rule)
    segments, cu_seqlens = documents(args)

    def normalised(q, k):  # as the layer's torch path gives them: float32 norm, back to the input dtype
        return (l2_normalize(q) * q.shape[-1] ** -0.5).to(q.dtype), l2_normalize(k).to(k.dtype)

    def ours(q, k, v, g, beta):
        return chunked_delta_rule(*normalised(q, k), v, g, beta, segments=segments)[0]

    if args.per_channel:
        return per_channel_implementations(ours)
    impls = {}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def fla(q, k, v, g, beta):
            flat = (lambda t: t.flatten(0, 1)[None]) if cu_seqlens is not None else (lambda t: t)
            out = chunk_gated_delta_rule(*(flat(t) for t in (q, k, v, g, beta)), cu_seqlens=cu_seqlens,
                                         use_qk_l2norm_in_kernel=True)[0]
            return out.view(args.batch, args.seq, *out.shape[2:])

        impls[FLA] = fla
    except ImportError:
        print("flash-linear-attention not installed: its column is left out")
    impls[TRITON_BF16 if args.dtype == torch.bfloat16 else "titan-models (triton)"] = (
        lambda q, k, v, g, beta: triton_chunked_delta_rule(q, k, v, g, beta, segments=segments, qk_l2norm=True)[0])
    if args.dtype == torch.bfloat16:  # the bf16 forward's cost in accuracy and its gain in time, in one run
        impls[TRITON_TF32] = lambda q, k, v, g, beta: triton_chunked_delta_rule(
            q, k, v, g, beta, segments=segments, bf16_forward=False, qk_l2norm=True)[0]
    impls[TRANSFORMERS] = lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    if args.titan_torch:
        impls["titan-models (torch)"] = ours
    return impls, ours


def per_channel_implementations(ours):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    chunk_kimi_delta_attention = inspect.unwrap(chunk_kimi_delta_attention)  # its torch form, not fla's kernel

    impls = {}
    try:
        from fla.ops.kda import chunk_kda

        impls[FLA] = lambda q, k, v, g, beta: chunk_kda(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    except ImportError:
        print("flash-linear-attention not installed: its column is left out")
    impls[TRANSFORMERS] = lambda q, k, v, g, beta: chunk_kimi_delta_attention(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    impls["titan-models (torch)"] = ours
    return impls, ours


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


def kernel_report(impls, args, *, backward: bool) -> None:
    """`--forward-kernels` / `--train-kernels`: titan-models' Triton forms and fla's (when installed), per
    kernel, over a forward (or a forward + backward step)."""
    from forward_kernels import kernel_times, print_kernel_times

    if args.device != "cuda":
        raise ValueError("--forward-kernels / --train-kernels need --device cuda (the profiler times CUDA kernels)")
    for name in (TRITON_BF16, "titan-models (triton)", TRITON_TF32, FLA):
        if name in impls:
            try:
                rows = kernel_times(impls[name], inputs(args, args.dtype), warmup=max(args.warmup, 1),
                                    repeats=args.repeats, backward=backward)
            except RuntimeError as error:  # fla-core 0.6's backward refuses triton 3.6 on Hopper
                print(f"{name}: refused here: {str(error).splitlines()[0]}")
                continue
            print_kernel_times(name, rows)


def print_table(rows) -> None:
    """rows [(name, rel err, fwd ms, fwd+bwd ms)]: ratios to transformers' and fla's times (> 1: faster)."""
    named = {row[0]: row for row in rows}
    print(f"{'implementation':32s} {'rel err vs fp64':>16s} {'fwd ms':>9s} {'x hf':>7s} {'x fla':>7s} "
          f"{'fwd+bwd ms':>11s} {'x hf':>7s} {'x fla':>7s}")

    def ratio(name, column, value):
        return f"{named[name][column] / value:7.3f}" if name in named else "      -"

    for name, err, fwd, both in rows:
        print(f"{name:32s} {err:16.2e} {fwd:9.2f} {ratio(TRANSFORMERS, 2, fwd)} {ratio(FLA, 2, fwd)} {both:11.2f} "
              f"{ratio(TRANSFORMERS, 3, both)} {ratio(FLA, 3, both)}", flush=True)


def run_rows(impls, reference_fn, args) -> list:
    """Each implementation's error, forward and forward + backward times, printed as each ends (with its
    ratio to fla's forward, timed first): a run cut by a time limit keeps what ended."""
    clock = time.perf_counter()
    print("float64 reference ...", flush=True)
    # titan-models' chunked form in float64 (tests/test_gated_deltanet.py holds it to a float64 recurrence)
    reference = reference_fn(*(t.double() for t in inputs(args, args.dtype))).double()
    print(f"  done ({time.perf_counter() - clock:.1f} s)", flush=True)
    rows = []
    for name, fn in impls.items():
        start = time.perf_counter()
        err = float("nan")
        if not (name == TRANSFORMERS and args.documents > 1):  # it has no document resets
            with torch.no_grad():
                err = ((fn(*inputs(args, args.dtype)).double() - reference).norm() / reference.norm()).item()
        fwd = timed(fn, args, backward=False)
        fla_fwd = rows[0][2] if rows and rows[0][0] == FLA else None
        vs_fla = f" ({fla_fwd / fwd:.3f}x fla)" if fla_fwd else ""
        print(f"  {name}: rel err {err:.2e}, fwd {fwd:.3f} ms{vs_fla} ({time.perf_counter() - start:.1f} s)", flush=True)
        rows.append((name, err, fwd, timed_unless_refused(name, fn, args)))
        print(f"  {name}: fwd+bwd {rows[-1][3]:.2f} ms ({time.perf_counter() - start:.1f} s with warm-up, "
              f"{time.perf_counter() - clock:.0f} s in all)", flush=True)
    return rows


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
    parser.add_argument("--titan-torch", action="store_true", help="also time titan-models' torch form")
    parser.add_argument("--scan-bv", type=int, default=None,
                        help="titan-models' scan V block (16, 32 or 64; default: its heuristic, 32 here)")
    parser.add_argument("--forward-kernels", action="store_true",
                        help="instead of the table: each Triton implementation's forward, kernel by kernel (CUDA)")
    parser.add_argument("--train-kernels", action="store_true",
                        help="instead of the table: each Triton implementation's forward + backward, kernel by kernel")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        if args.dtype != torch.float32:
            raise ValueError("--dtype bfloat16 needs --device cuda (bf16 tl.dot is wrong in Triton's interpreter)")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (by the kernels' first call)
    if args.scan_bv is not None:  # an experiment, not a setting: the kernels' heuristic is what the layer runs
        from titan_models.kernels import gated_delta_rule

        gated_delta_rule._Inputs._scan_block = lambda self: min(self.V, args.scan_bv)
        print(f"titan-models' scan V block forced to {args.scan_bv}")
    impls, reference_fn = implementations(args)
    if args.forward_kernels or args.train_kernels:
        return kernel_report(impls, args, backward=args.train_kernels)
    print(f"{'per-channel (KDA)' if args.per_channel else 'per-head'} delta rule, batch {args.batch}, seq {args.seq}, "
          f"{args.documents} document(s) per row, {args.heads} heads, dk {args.dk}, dv {args.dv}, {args.device}, "
          f"{str(args.dtype).removeprefix('torch.')} q/k/v, median of {args.repeats}", flush=True)
    print_table(run_rows(impls, reference_fn, args))


if __name__ == "__main__":
    main()
