"""The remat planner's plans for remat_frontier.py's run, on a CPU: the 8B built on meta (no memory, no compute),
profiled as the trainer does (compiled blocks), planned at each level; nothing runs on a GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/exec_layer/remat_preview.py [--batch 2]

Prints the planner's floor (the least budget it accepts, peak.py backward_floor), the predicted peak of every
block taking one option (keep: what the planner compares a budget with before recomputing anything, the
counterpart of mode none; recompute: of full checkpointing) and, per level, the plan's options and its planned
peak. ~30 s for the 32 layers (one block compiled on meta). The FeedForwards take the fused SwiGLU as the
trainer gives a CUDA run with training.fused_kernels (parallelizer.py); --unfused profiles titan-models' own.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from remat_frontier import model_setup, parse_args, plan_points  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--budgets", default="", help="comma list of GiB (default: remat_frontier.py's levels)")
    p.add_argument("--unfused", action="store_true",
                   help="profile titan-models' FeedForward, not the fused SwiGLU a CUDA run swaps in")
    own, rest = p.parse_known_args(argv)
    import titan_models
    from titan_train.cli import parse_args as train_args
    from titan_train.kernels.swiglu import use_fused_swiglu
    from titan_train.memory_estimate import remat_static_memory
    from titan_train.remat import peak_model, planned_under_budget, profile_blocks
    from titan_train.remat.apply import block_gradients
    from titan_train.remat.peak import backward_floor, block_transient
    from titan_train.remat.plan import GIB, OPTIONS, choose

    args = parse_args(rest)
    flags, shape = model_setup(args)
    config, _ = train_args([*flags, "--training.batch_size", str(own.batch)])
    cfg = titan_models.transforms.num_layers(shape.layers)(titan_models.flavor("llama3", "8B"))
    with torch.device("meta"):
        model = cfg.build()
    fused = config.training.fused_kernels and config.job.device == "cuda" and not own.unfused
    if fused:  # as parallelizer.py does on CUDA, before the planner profiles the blocks
        use_fused_swiglu(model)
    seq, tokens = config.training.seq_len, own.batch * config.training.seq_len
    memory = remat_static_memory(config, model, device=torch.device("cuda"), shards=1, tokens=tokens, autocast=False)
    profiles = profile_blocks(model, rows=own.batch, seq_len=seq, dtype=torch.bfloat16,
                              compiled=config.compile.effective_mode == "blocks")
    grads, transient = block_gradients(model, memory.gradient_bytes), block_transient(profiles)
    every_op = sum(op.bytes for op in profiles[0].ops)
    floor = backward_floor(profiles, memory, grads)
    print(f"{'fused' if fused else 'unfused'} SwiGLU; planner floor {floor / GIB:.2f} GiB (end of the backward "
          f"{memory.end_of_backward_bytes / GIB:.2f}); frontier_memory (fused) counts it "
          f"{shape.planner_floor_bytes(tokens) / GIB:.2f}")
    print(f"a kept block saves {profiles[0].saved_bytes / GIB:.3f} GiB (every op's output: {every_op / GIB:.3f})")
    for name, ops in OPTIONS.items():  # every block alike: keep ~ mode none, recompute ~ full
        uniform = [choose(b, name, ops) for b in profiles]
        print(f"every block {name}: predicted {peak_model(uniform, grads, memory, transient).total_bytes / GIB:.2f} "
              "GiB", flush=True)
    levels = ([float(b) for b in own.budgets.split(",")] if own.budgets else
              [pt.budget_gib for pt in plan_points(shape, tokens, args) if pt.budget_gib is not None])
    print("block 0 per option (GiB): " + "; ".join(
        f"{n} saved {c.saved_bytes / GIB:.3f} fwd {c.forward_peak_bytes / GIB:.3f} bwd +{c.backward_transient_bytes / GIB:.3f}"
        for n, c in ((n, choose(profiles[0], n, o)) for n, o in OPTIONS.items())))
    for level in levels:
        choices, model_peak = planned_under_budget(profiles, int(level * GIB), memory, grads)
        options = ", ".join(f"{n} {o}" for o, n in Counter(c.option for c in choices).items())
        print(f"budget {level:g} GiB: {options}; planned {model_peak.total_bytes / GIB:.2f} GiB (forward "
              f"{model_peak.forward_bytes / GIB:.2f}, backward {model_peak.backward_bytes / GIB:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
