"""One rank of the expert-parallel tests (launched by test_expert_parallel.py, gloo, CPU).

Every rank builds the same full MoE, computes the single-process reference over all ranks' tokens
itself, then runs the expert-parallel layer on its own tokens and compares outputs and gradients:
input gradients and the local expert shards directly, replicated weights (router, shared experts)
after summing the ranks' gradients. Writes a JSON report per rank.

usage: python ep_worker.py RANK WORLD_SIZE INIT_METHOD OUT_DIR BACKENDS (comma-separated: torch, triton;
triton runs the kernels through TRITON_INTERPRET=1 on CPU)
"""
from __future__ import annotations

import os
import sys

from dist_moe_rank_report import write_rank_report


def scenarios():
    # (name, config fields, tokens per rank as a function of rank, expert_bias setup)
    return [
        ("softmax_uneven", dict(num_experts=8, top_k=2, expert_dim=12), lambda r: 5 + 4 * r, "skew"),
        ("sigmoid_groups_shared_empty", dict(num_experts=8, top_k=3, expert_dim=10, score_func="sigmoid", n_group=4,
                                             topk_group=2, num_shared_experts=1, route_scale=2.5), lambda r: 7,
         "starve"),
    ]


def run(rank: int, world: int, backend: str) -> dict:
    import torch
    import torch.distributed as dist

    import dist_moe

    dtype = torch.float64 if backend == "torch" else torch.float32
    # Routing is float32 whatever the model dtype, so float32 rounding sets the tolerance.
    tol = 1e-6 if dtype == torch.float64 else 2e-5
    dim = 16
    group = dist.new_group(list(range(world)))
    report = {"rank": rank, "checks": {}, "host_reads": {}}
    # The interpreted kernels are slow: they run the scenario that covers the most (groups,
    # shared experts, empty experts); the torch path runs both.
    chosen = scenarios() if backend == "torch" else scenarios()[1:]
    for name, fields, tokens_of, bias_mode in chosen:
        torch.manual_seed(0)
        config = dist_moe.MoEConfig(dim=dim, backend=backend, **fields)
        reference = config.build().to(dtype)
        with torch.no_grad():
            e = config.num_experts
            if bias_mode == "skew":  # most tokens go to experts 0-2
                reference.expert_bias.copy_(torch.tensor([0.3, 0.2, 0.2] + [0.0] * (e - 3)))
            else:  # experts 5..7 receive nothing
                reference.expert_bias.copy_(torch.tensor([0.0] * 5 + [-10.0] * (e - 5)))
        counts = [tokens_of(r) for r in range(world)]
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(1, c, dim, generator=gen, dtype=dtype) for c in counts]
        grads = [torch.randn(1, c, dim, generator=gen, dtype=dtype) for c in counts]

        x_all = torch.cat(xs, dim=1).requires_grad_()
        ref_out = reference(x_all)
        ref_out.backward(torch.cat(grads, dim=1))
        ref_tokens = reference.tokens_per_expert.clone()

        moe = config.build().to(dtype)
        moe.load_state_dict(reference.state_dict())
        dist_moe.apply_expert_parallel(moe, group)
        x = xs[rank].clone().requires_grad_()
        with dist_moe.count_host_syncs() as forward_reads:
            out = moe(x)
        with dist_moe.count_host_syncs() as backward_reads:
            out.backward(grads[rank])
        report["host_reads"][name] = {"forward": forward_reads.reasons, "backward": backward_reads.reasons}

        lo = sum(counts[:rank])
        per_rank = config.num_experts // world
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        checks = {
            "output": (out, ref_out[:, lo:lo + counts[rank]]),
            "grad_x": (x.grad, x_all.grad[:, lo:lo + counts[rank]]),
        }
        for w in ("w1", "w2", "w3"):
            checks[f"grad_experts.{w}"] = (getattr(moe.experts, w).grad.to_local(),
                                           getattr(reference.experts, w).grad[experts])
        summed_tokens = moe.tokens_per_expert.clone()
        dist.all_reduce(summed_tokens, group=group)
        checks["tokens_per_expert"] = (summed_tokens, ref_tokens)
        replicated = [("router.gate.weight", moe.router.gate.weight, reference.router.gate.weight)]
        if moe.shared_experts is not None:
            for w in ("w1", "w2", "w3"):
                replicated.append((f"shared_experts.{w}.weight", getattr(moe.shared_experts, w).weight,
                                   getattr(reference.shared_experts, w).weight))
        for pname, mine, ref in replicated:
            g = mine.grad.clone()
            dist.all_reduce(g, group=group)
            checks[f"grad_{pname}"] = (g, ref.grad)
        results = {}
        for key, (got, want) in checks.items():
            err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
            scale = max(want.double().abs().max().item(), 1e-30) if want.numel() else 1.0
            results[key] = {"ok": err <= tol * scale, "err": err, "scale": scale}
        loads = ref_tokens.tolist()
        results["some_expert_empty_or_skewed"] = {"ok": (min(loads) == 0) if bias_mode == "starve"
                                                  else max(loads) >= 2 * min(loads), "loads": loads}
        if backend == "torch":
            results["overlap_all_to_all"] = _overlapped_is_bitwise(moe, xs[rank], grads[rank], out, x.grad)
        report["checks"][name] = results
    if backend == "torch":
        report["checks"]["taking_turns"] = _taking_turns(rank, group)
    return report


def _overlapped_is_bitwise(moe, x, grad, out, grad_x) -> dict:
    """The same forward and backward inside dist_moe.overlap_all_to_all: bitwise the blocking results, with
    hand_over called once per all-to-all (forward: split sizes, rows out, outputs back; backward: the two
    reverse exchanges)."""
    import torch

    import dist_moe

    calls = []
    x = x.clone().requires_grad_()
    with dist_moe.overlap_all_to_all(lambda: calls.append(1)):
        again = moe(x)
        n_forward = len(calls)
        again.backward(grad)
    counts = [n_forward, len(calls) - n_forward]
    return {"ok": torch.equal(again, out) and torch.equal(x.grad, grad_x) and counts == [3, 2], "hand_overs": counts}


def _two_moe_layers(seed: int, group):
    """Linear -> MoE -> Linear -> MoE with the experts split over `group` (a stand-in for a pipeline stage)."""
    import torch

    import dist_moe

    torch.manual_seed(seed)
    config = dist_moe.MoEConfig(dim=16, num_experts=4, top_k=2, expert_dim=8, num_shared_experts=1)
    layers = [torch.nn.Linear(16, 16), config.build(), torch.nn.Linear(16, 16), config.build()]
    for moe in layers[1::2]:
        dist_moe.apply_expert_parallel(moe, group)
    return torch.nn.Sequential(*layers)


def _taking_turns(rank: int, group) -> dict:
    """The forward of microbatch A through two MoE layers and the backward of microbatch B through two
    others as TakingTurns: A's output and B's gradients bitwise those of running the two in order, and the
    recorded turns: A's first all-to-all issued before B starts, and every exchange of either waited on
    ("resumed") only after the other has computed up to its own next exchange or its end."""
    import torch

    import dist_moe

    first, second = _two_moe_layers(0, group), _two_moe_layers(1, group)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
    x_a, x_b, grad_b = (torch.randn(1, 12, 16, generator=gen) for _ in range(3))

    def run(turns):
        second.zero_grad()
        x = x_b.clone().requires_grad_()
        out_b = second(x)  # B's forward came earlier
        out_a = []
        forward, backward = (lambda: out_a.append(first(x_a))), (lambda: out_b.backward(grad_b))
        if turns is None:
            forward()
            backward()
        else:
            turns.run(forward, backward)
        return [out_a[0], x.grad] + [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                     for p in second.parameters()]

    in_order = run(None)
    trace: list = []
    overlapped = run(dist_moe.TakingTurns(trace=trace))
    # A's forward makes 3 exchanges per MoE layer (6), B's backward 2 (4); A's last one finds B finished.
    f, b = "forward", "backward"
    expected = [(f, "start"), (f, "issued"), (b, "start")]
    for _ in range(4):
        expected += [(b, "issued"), (f, "resumed"), (f, "issued"), (b, "resumed")]
    expected += [(b, "end"), (f, "resumed"), (f, "end")]
    return {"bitwise": {"ok": all(torch.equal(got, want) for got, want in zip(overlapped, in_order, strict=True))},
            "turn_order": {"ok": trace == expected, "trace": trace}}


def main() -> None:
    rank, world, init_method, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    backends = sys.argv[5].split(",")
    if "triton" in backends:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        import dataclasses

        import triton.runtime.interpreter as interpreter

        # Integer-overflow checks of every interpreted op cost time and test nothing here.
        interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                      sanitize_overflow=False)
    write_rank_report(rank, world, init_method, out_dir,
                      lambda: {backend: run(rank, world, backend) for backend in backends})


if __name__ == "__main__":
    main()
