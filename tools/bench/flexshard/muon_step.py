"""Distributed Muon optimizer step: flexshard `Owned` against the usual FSDP2 approach, one run.

Both sides run the same `flexshard.optim.Muon` on the same transformer-shaped matrices with the
same gradients; only the sharding differs:
  flexshard   every Muon matrix Owned (whole on one rank, owners balanced): the owner orthogonalises
              it alone, `step()` issues no collective;
  fsdp2       torch `fully_shard` (row shards): per matrix, all-gather the momentum-mixed gradient,
              Newton–Schulz on every rank, keep the own rows.
Checks first that both give bit-identical weights, then times `optimizer.step()` (slowest rank per
step, median over steps) and counts collectives and bytes of one step.

    uv run --frozen --no-sync python tools/bench/flexshard/muon_step.py            # 4 gloo ranks, CPU
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/flexshard/muon_step.py --backend nccl --ns-dtype bf16 --dim 2048 --hidden 5632
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

try:
    import flexshard
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "flexshard" / "src"))
    import flexshard
from flexshard.optim import Muon, default_muon_rule, newton_schulz_flops


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


class Model(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Layer(args.dim, args.hidden) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)


def build(args, mesh, device, kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = Model(args).to(device)
    if kind == "flexshard":
        owned = lambda name, p: flexshard.Owned() if default_muon_rule(name, p) else flexshard.RowShard()  # noqa: E731
        for layer in model.layers:
            flexshard.shard(layer, mesh, placements=owned)
        flexshard.shard(model, mesh, placements=owned)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def set_grads(model: nn.Module, step: int, rank: int, device) -> None:
    """The local part of the same full gradient on both sides (generated identically everywhere)."""
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator(device=device).manual_seed(step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g, device=device)
        local = p._local_tensor
        if isinstance(local, flexshard.ChunkedShard):
            piece = flexshard.ChunkedShard(local._layout.local_from_full(full, rank), local._layout, rank)
        else:
            chunks = torch.chunk(full, p.device_mesh.size(), dim=0)
            piece = chunks[rank].contiguous() if rank < len(chunks) else full[:0].contiguous()
        p.grad = DTensor.from_local(piece, p.device_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())


def worker(rank: int, args, init_file: str, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if args.backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (args.world,))
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.ns_dtype]
    results = {}
    models = {}
    for kind in ("flexshard", "fsdp2"):
        model = build(args, mesh, device, kind)
        opt = Muon(model.named_parameters(), lr=0.02, ns_dtype=ns_dtype, adamw_lr=1e-3)
        times = []
        for step in range(args.warmup + args.steps):
            set_grads(model, step, rank, device)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            sync()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
            if step >= args.warmup:
                times.append(elapsed.item())
        set_grads(model, 10_000, rank, device)
        with flexshard.CollectiveCounter() as counter:
            opt.step()
        # Newton–Schulz work on this rank: the matrices it orthogonalises (all of them for fsdp2).
        flops = sum(
            newton_schulz_flops(tuple(p.shape))
            for n, p in model.named_parameters()
            if default_muon_rule(n, p) and (kind == "fsdp2" or p._local_tensor._layout.owner() == rank)
        )
        busiest = torch.tensor([flops], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        results[kind] = {"ms": 1e3 * statistics.median(times), "collectives": counter.count, "bytes": counter.bytes, "gflop": busiest.item() / 1e9}
        models[kind] = model
    # Correctness: the same gradients and the same Muon, so the same weights, bit for bit.
    same = all(
        torch.equal(flexshard.full_tensor(a), flexshard.full_tensor(b))
        for a, b in zip(models["flexshard"].parameters(), models["fsdp2"].parameters())
    )
    n_muon = sum(1 for n, p in models["flexshard"].named_parameters() if default_muon_rule(n, p))
    if rank == 0:
        queue.put({"results": results, "same": same, "n_muon": n_muon})
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--hidden", type=int, default=768, help="MLP width (default 768)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--ns-dtype", choices=["bf16", "fp32"], default="fp32",
        help="Newton–Schulz dtype (default fp32: CPUs without bf16 matmul run bf16 ~30x slower; use bf16 on GPU)",
    )
    args = parser.parse_args()
    print(f"Muon step, {args.world} {args.backend} ranks: {args.layers} layers, dim {args.dim}, hidden {args.hidden}, "
          f"NS in {args.ns_dtype}, median of {args.steps} steps", flush=True)
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "init"), queue), nprocs=args.world, start_method="spawn")
        out = queue.get()
    r = out["results"]
    print(f"correctness: flexshard and fsdp2 weights identical after {args.warmup + args.steps + 1} steps: {out['same']}")
    print(f"{'approach':<34} {'step ms':>9} {'collectives':>12} {'MiB moved':>10} {'NS GFLOP, busiest rank':>23}")
    labels = {"flexshard": "flexshard Muon (Owned)", "fsdp2": "fsdp2 (gather, NS on every rank)"}
    for kind in ("fsdp2", "flexshard"):
        print(f"{labels[kind]:<34} {r[kind]['ms']:>9.1f} {r[kind]['collectives']:>12} {r[kind]['bytes'] / 2**20:>10.2f} {r[kind]['gflop']:>23.2f}")
    ratio = r["flexshard"]["ms"] / r["fsdp2"]["ms"]
    print(f"step-time ratio flexshard / fsdp2: {ratio:.3f} (target <= 0.3); Muon matrices: {out['n_muon']}")
    if not out["same"]:
        sys.exit("weights differ between the two approaches")


if __name__ == "__main__":
    main()
