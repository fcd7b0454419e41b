"""A mixed remat plan's per-block memory on one GPU, measured against the planner's prediction (issue 20).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/exec_layer/remat_blocks.py \
        [--layers 8] [--batch 2] [--plan save_matmuls_attention*3,save_attention*3,recompute,keep] [--eager] \
        [--fused]

Llama 3 8B's blocks (--layers of them, the 8B's shapes) in bf16 on CUDA, each wrapped for its option as the
trainer wraps it (titan_train/remat/wrap.py) and compiled as compile.mode=blocks does (inductor; --eager: not),
their SwiGLU the trainer's fused one on CUDA with --fused (training.fused_kernels, the Triton backward),
run forward and backward once over random embeddings (after one warm-up pass that compiles), loss = sum of the
last block's output. Per block: what it holds after its forward (the allocator's growth across it, its output
left out, its input counted if it keeps it), the high mark of its forward and of its backward
(torch.cuda.max_memory_allocated between a hook on its output's gradient and one on its input's), against the
planner's figures for the same blocks (held.py on meta; peak.py's walks with the weights as the state, the
blocks' weight gradients as every gradient). Prints a line per block and the whole pass's peak; --check exits
1 when a measured figure exceeds its prediction by more than --tolerance (default 5%) of the block's high mark.
~1-2 minutes at 8 layers (4 compiled graphs, one per option), well under 20 GiB.
"""
from __future__ import annotations

import argparse
import sys

import torch

GIB = 2**30
DEVICE = "cuda"


def parse_plan(text: str, layers: int) -> list[str]:
    from titan_train.remat.plan import OPTIONS

    plan = []
    for part in text.split(","):
        name, _, count = part.strip().partition("*")
        if name not in OPTIONS:
            raise ValueError(f"--plan: {name!r} is not an option ({', '.join(OPTIONS)})")
        plan += [name] * int(count or 1)
    if len(plan) != layers:
        raise ValueError(f"--plan names {len(plan)} blocks, --layers is {layers}")
    return plan


def build(layers: int, flavor: str = "8B", fused: bool = False):
    import titan_models

    cfg = titan_models.transforms.num_layers(layers)(titan_models.flavor("llama3", flavor))
    with torch.device("meta"):
        model = cfg.build()
    if fused:
        from titan_train.kernels.swiglu import use_fused_swiglu

        use_fused_swiglu(model)
    model = model.to_empty(device=DEVICE).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model


def planner_choices(model, plan: list[str], rows: int, seq: int, compiled: bool) -> list:
    """The planner's choice for each block under `plan` (profiled on a meta copy, before anything compiles)."""
    from titan_train.remat import profile_blocks
    from titan_train.remat.plan import OPTIONS, choose

    profiles = profile_blocks(model, rows=rows, seq_len=seq, dtype=torch.bfloat16, compiled=compiled)
    return [choose(p, o, OPTIONS[o]) for p, o in zip(profiles, plan, strict=True)]


def predicted(model, choices: list, state: int) -> dict:
    """peak.py's walks for the choices, the state being what is allocated before the pass."""
    from titan_train.remat import StaticMemory, peak_model
    from titan_train.remat.peak import backward_walk, forward_walk

    grads = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.layers.values()]
    memory = StaticMemory(forward_bytes=state, gradient_bytes=sum(grads), gradients_persist=False)
    return {"choices": choices, "forward": forward_walk(choices, memory),
            "backward": backward_walk(choices, grads, memory), "total": peak_model(choices, grads, memory).total_bytes}


def run_pass(blocks, h: torch.Tensor, rope) -> dict:
    """One forward and backward through `blocks`: each block's saved bytes and forward and backward high marks
    (absolute, as the allocator counts), and the pass's peak."""
    n = len(blocks)
    out = {"saved": [0] * n, "forward": [0] * n, "backward": [0] * n}

    def boundary(i):  # on the gradient of block i's input (= block i-1's output): i's backward ends, i-1's starts
        def hook(grad):
            torch.cuda.synchronize()
            if i < n:
                out["backward"][i] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return hook

    leaf = h.detach().requires_grad_(True)
    x = leaf.clone()
    for i, block in enumerate(blocks):
        x.register_hook(boundary(i))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        y = block(x, rope)
        torch.cuda.synchronize()
        out["forward"][i] = torch.cuda.max_memory_allocated()
        after = torch.cuda.memory_allocated()
        nbytes = x.untyped_storage().nbytes()
        x = y  # the input's storage is freed now unless the block holds it
        kept_input = nbytes - (after - torch.cuda.memory_allocated())
        out["saved"][i] = after - before - y.untyped_storage().nbytes() + kept_input
    x.register_hook(boundary(n))
    loss = x.sum()
    del x, y
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    # the hooks reset the high mark at every block boundary: the pass's is the largest of the pieces
    out["peak"] = max(*out["forward"], *out["backward"], torch.cuda.max_memory_allocated())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--flavor", default="8B", help="titan_models' llama3 flavor")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--plan", default="save_matmuls_attention*3,save_attention*3,recompute,keep",
                   help="comma list of options, name*count repeats, one per block")
    p.add_argument("--eager", action="store_true", help="blocks not compiled")
    p.add_argument("--fused", action="store_true", help="the trainer's fused SwiGLU (Triton backward), as on CUDA")
    p.add_argument("--check", action="store_true", help="exit 1 if a measured figure exceeds its prediction")
    p.add_argument("--tolerance", type=float, default=0.05)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("remat_blocks.py measures the CUDA allocator: needs a GPU", file=sys.stderr)
        return 2
    from titan_train.remat.wrap import wrap_block
    from titan_train.remat.plan import OPTIONS

    plan = parse_plan(args.plan, args.layers)
    model = build(args.layers, args.flavor, args.fused)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=DEVICE)
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
        rope = tuple(t.to(h.dtype) for t in model.rope(torch.arange(args.seq, device=DEVICE).expand(*tokens.shape)))
    del tokens
    choices = planner_choices(model, plan, args.batch, args.seq, not args.eager)
    blocks = [wrap_block(b, OPTIONS[o]) for b, o in zip(model.layers.values(), plan, strict=True)]
    if not args.eager:
        for b in blocks:
            b.compile()
    run_pass(blocks, h, rope)  # warm-up: compiles
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    state = torch.cuda.memory_allocated()
    pred = predicted(model, choices, state)
    measured = run_pass(blocks, h, rope)
    return report(plan, pred, measured, state, args)


def report(plan: list[str], pred: dict, measured: dict, state: int, args) -> int:
    print(f"{args.layers} {args.flavor} blocks, batch {args.batch} x {args.seq}, {'eager' if args.eager else 'compiled'}"
          f"{', fused SwiGLU' if args.fused else ''}; "
          f"state before the pass {state / GIB:.3f} GiB (GiB below; forward/backward: absolute high marks)")
    print(f"{'block':>5s} {'option':24s} {'saved pred':>10s} {'meas':>7s} {'fwd pred':>9s} {'meas':>7s} "
          f"{'bwd pred':>9s} {'meas':>7s}")
    over = []
    for i, option in enumerate(plan):
        c = pred["choices"][i]
        row = [(c.saved_bytes, measured["saved"][i]), (pred["forward"][i], measured["forward"][i]),
               (pred["backward"][i], measured["backward"][i])]
        print(f"{i:5d} {option:24s} " + " ".join(f"{a / GIB:10.3f} {b / GIB:7.3f}" for a, b in row))
        scale = max(pred["backward"][i], 1) * args.tolerance
        over += [f"block {i} {name}" for name, (a, b) in zip(("saved", "forward", "backward"), row) if b > a + scale]
    print(f"pass peak: predicted {pred['total'] / GIB:.3f} GiB, measured {measured['peak'] / GIB:.3f} GiB")
    if measured["peak"] > pred["total"] * (1 + args.tolerance):
        over.append("pass peak")
    print("over prediction: " + (", ".join(over) or "none"))
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
