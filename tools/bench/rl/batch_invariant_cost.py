"""Cost of titan-rl's batch-invariant mode, and the trainer/generator logprob mismatch without it.

Self-checking: the batch-invariant ops are first compared with a float64 reference (and their
batch invariance checked) on the device; then the same model is timed in normal mode (the anchor)
and in batch-invariant mode:
  - logprobs: the trainer's forward + log-softmax over [batch, seq] tokens (no grad);
  - train step: forward + backward of the mean logprob;
  - generate: built-in generator, batched prefill + decode.
and the generator's logprobs are compared with the trainer's in both modes.

CPU (here):   uv run --frozen --no-sync python tools/bench/rl/batch_invariant_cost.py
GPU (lead):   PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/rl/batch_invariant_cost.py \
                  --size 1B --dtype bfloat16 --batch 8 --seq 1024
"""
from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time

import torch

import titan_models as tm
from titan_rl import BuiltinGenerator, SamplingConfig, batch_invariant, token_logprobs
from titan_rl.batch_invariant import ops

SIZES = {
    # dim, layers, heads, kv heads, ffn, vocab
    "debug": (256, 4, 4, 2, 768, 2048),
    "150M": (768, 12, 12, 4, 2048, 32000),
    "1B": (2048, 16, 32, 8, 8192, 128256),
}


def build(size: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    dim, layers, heads, kv, ffn, vocab = SIZES[size]
    config = tm.llama3.Llama3Config(vocab_size=vocab, dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                                    ffn_dim=ffn, max_seq_len=8192, dtype=dtype)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


def self_check(device: str, dtype: torch.dtype) -> list[tuple[str, float, bool]]:
    """(op, max relative error vs float64, batch-invariant?) for each op, on this device."""
    torch.manual_seed(0)
    rows = []
    x = torch.randn(100, 512, device=device).to(dtype)
    w = torch.randn(384, 512, device=device).to(dtype)
    ref = x.double() @ w.double().T
    out = ops.matmul(x, w)
    inv = all(torch.equal(ops.matmul(x[i:i + 1], w)[0], out[i]) for i in range(0, 100, 9))
    rows.append(("matmul", float((out.double() - ref).abs().max() / ref.abs().max()), inv))
    wn = torch.rand(512, device=device).to(dtype) + 0.5
    xd = x.double()
    ref = (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)) * wn.double()
    out = ops.rms_norm(x, wn, 1e-5)
    inv = all(torch.equal(ops.rms_norm(x[i:i + 1], wn, 1e-5)[0], out[i]) for i in range(0, 100, 9))
    rows.append(("rms_norm", float((out.double() - ref).abs().max() / ref.abs().max()), inv))
    z = torch.randn(20, 5000, device=device).to(dtype) * 3
    ref = torch.log_softmax(z.double(), -1)
    out = ops.log_softmax(z)
    inv = all(torch.equal(ops.log_softmax(z[i:i + 1])[0], out[i]) for i in range(20))
    rows.append(("log_softmax", float((out.double() - ref).abs().max() / ref.abs().max()), inv))
    q = torch.randn(3, 150, 4, 64, device=device).to(dtype)
    k = torch.randn(3, 150, 2, 64, device=device).to(dtype)
    v = torch.randn(3, 150, 2, 64, device=device).to(dtype)
    pos = torch.arange(150, device=device).expand(3, 150)
    s = torch.einsum("bshd,blhd->bhsl", q.double(), k.double().repeat_interleave(2, 2)) / 8
    s = s.masked_fill(torch.arange(150, device=device)[None, None, None] > pos[:, None, :, None], -math.inf)
    ref = torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v.double().repeat_interleave(2, 2))
    out = ops.attention(q, k, v, q_positions=pos, scale=1 / 8)
    one = ops.attention(q[1:2, 149:150], k[1:2], v[1:2], q_positions=pos[1:2, 149:150], scale=1 / 8)
    rows.append(("attention", float((out.double() - ref).abs().max() / ref.abs().max()), torch.equal(one[0, 0], out[1, 149])))
    return rows


def timed_pair(fn_a, fn_b, device: str, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds of each, alternating a and b so that load drift hits both alike."""
    best = [math.inf, math.inf]
    for fn in (fn_a, fn_b):
        fn()  # warm-up (Triton compiles here)
    for _ in range(repeats):
        for i, fn in enumerate((fn_a, fn_b)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def mismatch(model, prompts, new_tokens: int) -> tuple[float, float]:
    gen = BuiltinGenerator(model)
    comps = gen.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, seed=0))
    device = next(model.parameters()).device
    seqs = [c.prompt + c.tokens for c in comps]
    tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long, device=device)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        lp = token_logprobs(model, tokens).cpu()
    diffs = torch.cat([(lp[r, len(c.prompt) - 1:len(c.prompt) - 1 + len(c.tokens)] - c.logprobs).abs()
                       for r, c in enumerate(comps)])
    return float(diffs.max()), float(diffs.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="debug")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = args.device
    print(f"device={device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu, %d threads' % torch.get_num_threads()})"
          f" torch={torch.__version__} size={args.size} dtype={args.dtype} batch={args.batch} seq={args.seq}", flush=True)

    check = self_check(device, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for op, err, inv in check:
        print(f"  check {op:12s} rel.err {err:.2e} {'ok' if err < tol else 'FAIL'}  batch-invariant {'yes' if inv else 'NO'}")
    if any(err >= tol or not inv for _, err, inv in check):
        sys.exit("self-check failed: timings would be meaningless")

    normal = build(args.size, dtype, device)
    invariant = batch_invariant(copy.deepcopy(normal))
    vocab = SIZES[args.size][5]
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.seq // 4, args.seq))] for _ in range(args.batch)]

    def logprobs(model):
        with torch.no_grad():
            token_logprobs(model, tokens)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        token_logprobs(model, tokens).mean().backward()

    def generate(model):
        BuiltinGenerator(model).generate(prompts, SamplingConfig(max_new_tokens=args.new_tokens, seed=0))

    results = []
    for name, fn in (("logprobs", logprobs), ("train step", train_step), ("generate", generate)):
        t_normal, t_inv = timed_pair(lambda fn=fn: fn(normal), lambda fn=fn: fn(invariant), device, args.repeats)
        results.append((name, t_normal, t_inv))
    mm_normal = mismatch(normal, prompts[:4], args.new_tokens)
    mm_inv = mismatch(invariant, prompts[:4], args.new_tokens)

    print()
    print(f"{'workload':12s} {'normal s':>10s} {'invariant s':>12s} {'ratio':>7s}")
    for name, t_normal, t_inv in results:
        print(f"{name:12s} {t_normal:10.4f} {t_inv:12.4f} {t_inv / t_normal:7.2f}x")
    print()
    print(f"generator vs trainer |dlogprob| (4 prompts x {args.new_tokens} tokens):")
    print(f"  normal mode:          max {mm_normal[0]:.3g}  mean {mm_normal[1]:.3g}")
    print(f"  batch-invariant mode: max {mm_inv[0]:.3g}  mean {mm_inv[1]:.3g}")
    if mm_inv[0] != 0.0:
        sys.exit("batch-invariant mode did not give bitwise-equal logprobs")


if __name__ == "__main__":
    main()
