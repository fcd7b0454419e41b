"""Distributed Muon: flexshard `Owned` against FSDP2 Muon, gathering everything and load-balanced, one run.

The three run the same Muon math on the same transformer-shaped matrices; only the sharding differs:
  flexshard      every Muon matrix Owned (whole on one rank, owners balanced): the owner orthogonalises
                 it alone, `step()` issues no collective;
  fsdp2          torch `fully_shard` (row shards): per matrix, all-gather the momentum-mixed update,
                 Newton–Schulz on every rank, keep the own rows;
  fsdp2_balanced torch `fully_shard`, the Newton–Schulz work load-balanced: matrix i's owner is rank
                 i mod world (round-robin); the owner gathers the update's row shards, orthogonalises,
                 and scatters the rows back (all gathers launched first, then each rank's own matrices).
Checks first that all three give bit-identical weights from the same gradients, then times the whole
training step (forward, backward, optimizer step; the slowest rank per step) in rounds, the
approaches taking turns, and reports the median over all rounds' steps; also `optimizer.step()`
alone, and collectives and bytes of one step.

    uv run --frozen --no-sync python tools/bench/flexshard/muon_step.py            # 4 gloo ranks, CPU
    uv run --frozen --no-sync python tools/bench/flexshard/muon_step.py --dry-run  # 2 ranks, tiny: does it run
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/flexshard/muon_step.py --backend nccl --ns-dtype bf16 --dim 2048 --hidden 5632
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

try:
    import flexshard
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "flexshard" / "src"))
    import flexshard
from flexshard.optim import Muon, default_muon_rule, newton_schulz, newton_schulz_flops
from flexshard.slot import local_flat

KINDS = ("flexshard", "fsdp2", "fsdp2_balanced")


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.heads = max(1, dim // 64)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape  # batch, sequence, width
        x = self.attention_norm(h)
        q, k, v = (w(x).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        h = h + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class Model(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Layer(args.dim, args.hidden) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class BalancedMuon(Muon):
    """FSDP2 Muon with the Newton–Schulz work spread over the ranks: matrix i (in parameter order) is
    orthogonalised on rank i mod world. Every update's row shards are gathered to its owner first
    (asynchronous), then each rank orthogonalises the matrices it owns and scatters their rows back,
    so the ranks' Newton–Schulz runs at the same time. Same math as Muon, so the same weights."""

    def __init__(self, named_params, **kwargs):
        super().__init__(named_params, **kwargs)
        muon = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        self.owner = {p: i % dist.get_world_size() for i, p in enumerate(muon)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["use_muon"]:
                for p in params:
                    self._adamw_update(p, group)
                continue
            gathers = [self._gather_update(p, group) for p in params]
            scatters = [self._orthogonalise_owned(*g, group) for g in gathers]
            for p, rows, work in scatters:
                work.wait()
                self._apply(p, rows, group)

    def _gather_update(self, p, group):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        grad, buf, mu = local_flat(p.grad), local_flat(state["momentum_buffer"]), group["momentum"]
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        world, local_rows = dist.get_world_size(), p._local_tensor.shape[0]
        padded = update.new_zeros(-(-p.shape[0] // world), p.shape[1])  # torch.chunk rows, padded equal
        padded[:local_rows] = update.view(local_rows, p.shape[1])
        gathered = [torch.empty_like(padded) for _ in range(world)] if dist.get_rank() == self.owner[p] else None
        return p, padded, gathered, dist.gather(padded, gathered, dst=self.owner[p], async_op=True)

    def _orthogonalise_owned(self, p, padded, gathered, work, group):
        work.wait()
        rows = torch.empty(padded.shape, dtype=group["ns_dtype"], device=padded.device)
        pieces = None
        if gathered is not None:  # this rank owns p
            orth = newton_schulz(torch.cat(gathered)[:p.shape[0]], steps=group["ns_steps"], dtype=group["ns_dtype"])
            full = orth.new_zeros(padded.shape[0] * len(gathered), p.shape[1])
            full[:p.shape[0]] = orth
            pieces = list(full.chunk(len(gathered)))
        return p, rows, dist.scatter(rows, pieces, src=self.owner[p], async_op=True)

    def _apply(self, p, rows, group):
        weight = local_flat(p)
        orth = rows[:p._local_tensor.shape[0]].reshape(-1)
        m, n = p.shape[-2], p.shape[-1]
        scale = {None: 1.0, "spectral": max(1.0, m / n) ** 0.5, "match_adamw_rms": 0.2 * math.sqrt(max(m, n))}[group["adjust_lr"]]
        weight.mul_(1 - group["lr"] * group["weight_decay"])
        weight.add_(orth.to(weight.dtype), alpha=-group["lr"] * scale)


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


def make_optimizer(kind: str, model: nn.Module, ns_dtype: torch.dtype) -> Muon:
    cls = BalancedMuon if kind == "fsdp2_balanced" else Muon
    return cls(model.named_parameters(), lr=0.02, ns_dtype=ns_dtype, adamw_lr=1e-3)


def timed(fn, sync) -> float:
    """Seconds of fn() on the slowest rank (every rank starts together)."""
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
    return elapsed.item()


def train_step(model: nn.Module, opt: Muon, tokens: torch.Tensor, losses: list) -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.detach())


def ns_gflop_busiest(kind: str, model: nn.Module, opt: Muon, rank: int) -> float:
    """Newton–Schulz work of the busiest rank: the matrices each rank orthogonalises."""
    def mine(p) -> bool:
        if kind == "fsdp2":
            return True
        if kind == "fsdp2_balanced":
            return opt.owner[p] == rank
        return p._local_tensor._layout.owner() == rank
    flops = sum(newton_schulz_flops(tuple(p.shape)) for n, p in model.named_parameters() if default_muon_rule(n, p) and mine(p))
    busiest = torch.tensor([flops], dtype=torch.float64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    return busiest.item() / 1e9


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
    models = {k: build(args, mesh, device, "flexshard" if k == "flexshard" else "fsdp2") for k in KINDS}
    opts = {k: make_optimizer(k, models[k], ns_dtype) for k in KINDS}
    # 1. The optimizer step alone, from the same gradients (so the weights must stay bit-identical).
    opt_times = {k: [] for k in KINDS}
    for step in range(args.warmup + args.steps):
        for kind in KINDS:  # taking turns
            set_grads(models[kind], step, rank, device)
            seconds = timed(opts[kind].step, sync)
            if step >= args.warmup:
                opt_times[kind].append(seconds)
    results = {}
    for kind in KINDS:
        set_grads(models[kind], 10_000, rank, device)
        with flexshard.CollectiveCounter() as counter:
            opts[kind].step()
        results[kind] = {"opt_ms": 1e3 * statistics.median(opt_times[kind]), "collectives": counter.count,
                         "bytes": counter.bytes, "gflop": ns_gflop_busiest(kind, models[kind], opts[kind], rank)}
    same = {kind: all(torch.equal(flexshard.full_tensor(a), flexshard.full_tensor(b))
                      for a, b in zip(models["flexshard"].parameters(), models[kind].parameters())) for kind in KINDS}
    for opt in opts.values():
        opt.zero_grad()
    # 2. The whole training step, real forward and backward, in rounds taking turns (first step untimed).
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank)).to(device)
    step_times, losses = {k: [] for k in KINDS}, {k: [] for k in KINDS}
    for round_ in range(args.rounds):
        for kind in KINDS:
            for i in range(args.steps + (round_ == 0)):
                seconds = timed(lambda: train_step(models[kind], opts[kind], tokens, losses[kind]), sync)
                if round_ or i:
                    step_times[kind].append(seconds)
    for kind in KINDS:
        results[kind]["step_ms"] = 1e3 * statistics.median(step_times[kind])
        results[kind]["step_ms_range"] = (1e3 * min(step_times[kind]), 1e3 * max(step_times[kind]))
        results[kind]["last_loss"] = losses[kind][-1].item()
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
    parser.add_argument("--steps", type=int, default=10, help="timed steps per approach per round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of whole training steps, approaches taking turns (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (default 1)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per training step (default 2)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--ns-dtype", choices=["bf16", "fp32"], default="fp32",
        help="Newton–Schulz dtype (default fp32: CPUs without bf16 matmul run bf16 ~30x slower; use bf16 on GPU)",
    )
    parser.add_argument("--dry-run", action="store_true", help="2 ranks, a tiny model, 2 steps: checks that it runs")
    args = parser.parse_args()
    if args.dry_run:
        args.world, args.dim, args.hidden, args.layers, args.vocab = 2, 128, 256, 2, 256
        args.steps, args.rounds, args.seq = 2, 2, 32
    print(f"Muon, {args.world} {args.backend} ranks: {args.layers} layers, dim {args.dim}, hidden {args.hidden}, "
          f"NS in {args.ns_dtype}; whole training steps: {args.rounds} rounds x {args.steps} steps of "
          f"{args.batch} x {args.seq} tokens per rank, medians", flush=True)
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "init"), queue), nprocs=args.world, start_method="spawn")
        out = queue.get()
    r = out["results"]
    print(f"correctness: weights bit-identical to flexshard's after {args.warmup + args.steps + 1} optimizer steps "
          f"from the same gradients: {out['same']}")
    labels = {"flexshard": "flexshard Muon (Owned)", "fsdp2": "fsdp2 (gather all, NS on every rank)",
              "fsdp2_balanced": "fsdp2 balanced (NS round-robin)"}
    print(f"{'approach':<38} {'train step ms':>13} {'(min-max)':>15} {'opt step ms':>11} {'collectives':>11} "
          f"{'MiB moved':>9} {'NS GFLOP busiest':>16} {'last loss':>9}")
    for kind in ("fsdp2", "fsdp2_balanced", "flexshard"):
        v = r[kind]
        lo, hi = v["step_ms_range"]
        print(f"{labels[kind]:<38} {v['step_ms']:>13.1f} {f'{lo:.0f}-{hi:.0f}':>15} {v['opt_ms']:>11.1f} "
              f"{v['collectives']:>11} {v['bytes'] / 2**20:>9.2f} {v['gflop']:>16.2f} {v['last_loss']:>9.4f}")
    for anchor in ("fsdp2", "fsdp2_balanced"):
        print(f"flexshard / {anchor}: whole training step {r['flexshard']['step_ms'] / r[anchor]['step_ms']:.3f}, "
              f"optimizer step {r['flexshard']['opt_ms'] / r[anchor]['opt_ms']:.3f} (target for the optimizer step "
              f"against fsdp2: <= 0.3); Muon matrices: {out['n_muon']}")
    if not all(out["same"].values()):
        sys.exit("weights differ between the approaches")

if __name__ == "__main__":
    main()
