"""DualPipeV's paired forward/backward with the expert all-to-alls overlapped (titan-train's
parallelism.pp_overlap_ep) against the same pair run in order, on P expert-parallel ranks.

    torchrun --nproc-per-node 2 tools/bench/moe/bench_overlap.py                  # gloo, CPU
    torchrun --nproc-per-node 2 tools/bench/moe/bench_overlap.py --device cuda --dim 2048 --tokens 8192 \
        --experts 64 --top-k 6 --expert-dim 1024                                     # NCCL, one GPU a rank

(with PYTHONPATH=$(ls -d packages/*/src | paste -sd:) outside the uv environment.) Each rank holds two
stand-in stages of `--layers` blocks (two Linears and a SiLU for attention, then a dist-moe MoE layer with
its experts split over the ranks). A measured pair is the forward of microbatch A through the first
stage and the backward of microbatch B through the second (B's forward runs before, untimed), either one
after the other (the anchor) or as dist_moe.TakingTurns; the two take turns being
timed, all ranks starting together, medians over `--rounds`. Prints both medians and overlapped / in order
(below 1: the overlap pays), and checks first that both give bitwise the same results. On a shared CPU
the exchanges and the compute compete for the same cores, so the ratio there says little.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import dist_moe


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per microbatch and rank")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2, help="blocks per stage")
    p.add_argument("--rounds", type=int, default=10)
    return p.parse_args()


def stage(args, seed: int, group, device) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    config = dist_moe.MoEConfig(dim=args.dim, num_experts=args.experts, top_k=args.top_k, expert_dim=args.expert_dim)
    blocks = []
    for _ in range(args.layers):
        moe = dist_moe.apply_expert_parallel(config.build(), group)
        blocks += [torch.nn.Linear(args.dim, args.dim), torch.nn.SiLU(), torch.nn.Linear(args.dim, args.dim), moe]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype)


def main() -> None:
    args = parse_args()
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, group = dist.get_rank(), dist.new_group(list(range(dist.get_world_size())))
    first, second = stage(args, 0, group, device), stage(args, 1, group, device)
    dtype = next(first.parameters()).dtype
    gen = torch.Generator(device=device).manual_seed(10 + rank)
    x_a, x_b, grad_b = (torch.randn(args.tokens // 16, 16, args.dim, generator=gen, device=device, dtype=dtype)
                        for _ in range(3))

    def pair(overlapped: bool) -> tuple[float, list[torch.Tensor]]:
        second.zero_grad()
        out_b = second(x_b.clone().requires_grad_())  # B's forward, earlier in the schedule: not timed
        out_a = []
        forward, backward = (lambda: out_a.append(first(x_a))), (lambda: out_b.backward(grad_b))
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        if overlapped:
            dist_moe.TakingTurns().run(forward, backward)
        else:
            forward()
            backward()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        return elapsed, [out_a[0].detach()] + [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                                for p in second.parameters()]

    plain, overlapped = pair(False), pair(True)  # warm-up, and the check that both compute the same
    same = all(torch.equal(a, b) for a, b in zip(plain[1], overlapped[1], strict=True))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for variant in ((False, True) if r % 2 == 0 else (True, False)):
            times[variant].append(pair(variant)[0])
    if rank == 0:
        in_order, turns = statistics.median(times[False]), statistics.median(times[True])
        print(f"{dist.get_world_size()} ranks on {args.device}, {args.layers} MoE blocks a stage, {args.tokens} tokens, "
              f"dim {args.dim}, {args.experts} experts top-{args.top_k} width {args.expert_dim}; bitwise same: {same}")
        print(f"in order {in_order * 1e3:.2f} ms, overlapped {turns * 1e3:.2f} ms (medians of {args.rounds}); "
              f"overlapped / in order = {turns / in_order:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
