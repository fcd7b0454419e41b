"""`python -m titan_rl.demo`: GRPO on a tiny Llama learning to sort digits, on CPU, in about a minute.

Prints one line per step (reward, advantage spread, KL, logprob mismatch, staleness, throughput)
and saves the curve as CSV (and JSON) under --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import titan_models as tm
import torch

from titan_rl.algorithms import dapo, grpo, gspo
from titan_rl.batch_invariant import batch_invariant
from titan_rl.envs import SingleTurn, SortingTask
from titan_rl.generation import BuiltinGenerator, SamplingConfig
from titan_rl.loop import RLConfig, RLLoop
from titan_rl.tokenizer import CharTokenizer

ALGORITHMS = {"grpo": grpo, "dapo": dapo, "gspo": gspo}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    args = _parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer("0123456789sort:=\n")
    policy = _build_policy(tokenizer, seed=args.seed, batch_invariant_ops=args.batch_invariant)
    loop = _build_loop(policy, tokenizer, args)
    print(f"{args.algorithm} on sorting 3 digits: {sum(p.numel() for p in policy.parameters())} parameters, "
          f"{args.prompts_per_step}x{args.group_size} samples/step, max policy lag {args.max_policy_lag}", flush=True)
    start = time.perf_counter()
    curve = _run_steps(loop, args.steps)
    first, last = curve[: min(5, len(curve))], curve[-min(5, len(curve)):]
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)
    print(f"reward: first steps {mean(first):.3f} -> last steps {mean(last):.3f} "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    _save_curve(curve, args.out)
    return curve


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m titan_rl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="RL steps (default 60)")
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="grpo")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--max-policy-lag", type=int, default=0,
                        help="0: synchronous; k > 0: generate in the background from weights <= k steps old")
    parser.add_argument("--batch-invariant", action="store_true", help="bitwise-equal trainer/generator logprobs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("outputs/titan-rl-demo"), help="where the curve is saved")
    return parser.parse_args(argv)


def _build_policy(tokenizer: CharTokenizer, *, seed: int, batch_invariant_ops: bool) -> torch.nn.Module:
    """The tiny Llama being trained, initialized on CPU from `seed`."""
    config = tm.llama3.Llama3Config(vocab_size=tokenizer.vocab_size, dim=64, num_layers=2, num_heads=1,
                                    num_kv_heads=1, ffn_dim=192, max_seq_len=64)
    with torch.device("meta"):
        policy = config.build()
    policy.to_empty(device="cpu")
    policy.init_weights(seed=seed)
    if batch_invariant_ops:
        batch_invariant(policy)
    return policy


def _build_loop(policy: torch.nn.Module, tokenizer: CharTokenizer, args: argparse.Namespace) -> RLLoop:
    """The RL loop on 3-digit sorting, generating with the built-in generator."""
    generator = BuiltinGenerator(policy, copy_model=args.max_policy_lag > 0, pad_id=tokenizer.pad_id)
    newline = tokenizer.encode("\n")[0]
    return RLLoop(
        policy=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99)),
        generator=generator, tokenizer=tokenizer,
        make_env=lambda: SingleTurn(SortingTask(min_length=3, max_length=3)),
        config=RLConfig(algorithm=ALGORITHMS[args.algorithm](group_size=args.group_size),
                        prompts_per_step=args.prompts_per_step, max_policy_lag=args.max_policy_lag, seed=args.seed,
                        sampling=SamplingConfig(max_new_tokens=4, stop_token_ids=(newline,))),
    )


def _run_steps(loop: RLLoop, steps: int) -> list[dict[str, float]]:
    """Run `steps` steps, printing one table row each; the loop is closed even if a step fails."""
    print(f"{'step':>4} {'reward':>7} {'adv_std':>7} {'kl':>8} {'mismatch':>9} {'stale':>5} {'dropped':>7} "
          f"{'gen tok/s':>9} {'train tok/s':>11}", flush=True)
    curve = []
    try:
        for _ in range(steps):
            m = loop.step()
            curve.append(m)
            print(f"{int(m['step']):4d} {m['reward_mean']:7.3f} {m['adv_std']:7.3f} {m['kl']:8.2e} "
                  f"{m['logprob_mismatch_max']:9.2e} {int(m['staleness']):5d} {int(m['dropped_samples_total']):7d} "
                  f"{m['gen_tokens_per_s']:9.0f} {m['train_tokens_per_s']:11.0f}", flush=True)
    finally:
        loop.close()
    return curve


def _save_curve(curve: list[dict[str, float]], out: Path) -> None:
    """Write the per-step metrics as out/curve.csv and out/curve.json."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    (out / "curve.json").write_text(json.dumps(curve, indent=1))
    print(f"saved {out / 'curve.csv'}")


if __name__ == "__main__":
    main()
