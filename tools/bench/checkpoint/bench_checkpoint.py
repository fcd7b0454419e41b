"""torch-checkpointing against torch.distributed.checkpoint (DCP) on the same state, in one run.

For each: save (DCP: save; ours: save(blocking=True)), async save (first and repeated), load, and
the collectives each save runs (counted by the process group's sequence number). The anchor is the
disk itself: each rank writes and fsyncs a file as large as its state, at the same time.

After every async save the benchmark changes the state at once, as a trainer's optimizer step
would; every load is then checked bitwise against the state as it was when that save was called.

    # CPU, 4 gloo ranks, 256 MiB of state in all
    python tools/bench/checkpoint/bench_checkpoint.py --ranks 4 --size-gib 0.25
    # one GPU, 8 GiB of state
    python tools/bench/checkpoint/bench_checkpoint.py --device cuda --size-gib 8 --dir /path/on/local/disk
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import torch_checkpointing as tc

TARGETS = {"repeat blocking": 1 / 50, "repeat total": 0.6, "load": 0.5}  # ours / DCP async_save (load: / DCP load)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks on CPU (ignored under torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives (cuda: one GPU per rank)")
    p.add_argument("--size-gib", type=float, default=0.25, help="state size summed over all ranks, GiB")
    p.add_argument("--tensors", type=int, default=64, help="number of tensors (alternately bf16 and fp32)")
    p.add_argument("--repeats", type=int, default=1, help="repeated async saves measured after the first (median)")
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a new folder in the temp dir)")
    p.add_argument("--io-threads", type=int, default=None, help="torch-checkpointing writer/reader threads (default: its own)")
    p.add_argument("--dcp-threads", type=int, default=None,
                   help="DCP FileSystemWriter thread_count (default: DCP's defaults, chosen from the path)")
    return p.parse_args()


# ---- the state -------------------------------------------------------------------------------------

def make_state(args, rank: int, world: int, device: torch.device) -> dict:
    """`tensors` tensors, alternately bf16 and fp32, about size/world bytes on this rank.

    With several ranks each tensor is a DTensor sharded by rows (made from local data, no collective).
    """
    per_rank = int(args.size_gib * 2**30) // world
    cols = 4096
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    state = {}
    for i in range(args.tensors):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        rows = max(1, per_rank // args.tensors // (cols * dtype.itemsize))
        local = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32).to(dtype)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard
            local = DTensor.from_local(local, mesh, [Shard(0)], shape=(rows * world, cols),
                                       stride=(cols, 1), run_check=False)
        state[f"layers.{i}.weight" if i % 2 == 0 else f"optim.{i}.exp_avg"] = local
    return {"model": state, "step": 0}


def _locals(state: dict) -> list[torch.Tensor]:
    return [t._local_tensor if hasattr(t, "_local_tensor") else t for t in state["model"].values()]


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in _locals(state))


def snapshot(state: dict) -> list[torch.Tensor]:
    return [t.clone() for t in _locals(state)]


def change(state: dict) -> None:
    """What an optimizer step does: change every tensor in place (queued on the current stream)."""
    for t in _locals(state):
        t.add_(1.0)
    state["step"] += 1


def empty_like(state: dict) -> dict:
    model = {}
    for name, t in state["model"].items():
        if hasattr(t, "_local_tensor"):
            from torch.distributed.tensor import DTensor
            model[name] = DTensor.from_local(torch.zeros_like(t._local_tensor), t.device_mesh, t.placements,
                                             shape=t.shape, stride=t.stride(), run_check=False)
        else:
            model[name] = torch.zeros_like(t)
    return {"model": model, "step": -1}


def check(loaded: dict, expected: list[torch.Tensor], what: str) -> None:
    for got, want in zip(_locals(loaded), expected):
        if not torch.equal(got, want):
            raise AssertionError(f"{what}: the loaded state differs from the state at save time")


def correctness_checks(root: Path, device: torch.device) -> None:
    """Before any timing: mixed dtypes, strided and 0-dim tensors, CPU tensors next to device ones,
    many staging slabs, a change right after save(), manual release, same-layout and casting loads."""
    g = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(1024, 1000, generator=g, device=device)
    state = {"f32": base, "bf16": base[:300].bfloat16(), "strided": base[:, :700].t(), "scalar": base[0, 0],
             "ints": torch.arange(1000, device=device), "flags": base[0] > 0, "host": torch.ones(5, 3),
             "rng": torch.get_rng_state(), "step": 7, "blob": b"abc"}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with tc.Checkpointer(root / "check", slab_bytes=1 << 20, block_bytes=1 << 16, per_rank=("rng",)) as ckpt:
        handle = ckpt.save(1, state)
        base.mul_(-1.0)  # queued after the staging copies: must not reach the checkpoint
        handle.wait()
        handle = ckpt.save(2, state, manual_release=True)
        handle.wait_staged()
        base.mul_(-1.0)  # back to the original values only now
        handle.wait()
        for step, sign in ((1, 1.0), (2, -1.0)):
            same = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
            cast = {**same, "f32": torch.zeros(1024, 1000, dtype=torch.float64, device=device),
                    "strided": torch.zeros(700, 1024, dtype=torch.float64, device=device)}
            for target in (same, cast):
                ckpt.load(target, step=step)
                for k, v in expected.items():
                    got = target[k]
                    if isinstance(v, torch.Tensor):
                        want = v * sign if k in ("f32", "strided", "scalar") else v  # the views of `base`
                        if got.device != v.device or not torch.equal(got.to(v.dtype), want):
                            raise AssertionError(f"correctness check: {k!r} of step {step} loaded wrong")
                    elif got != v:
                        raise AssertionError(f"correctness check: {k!r} of step {step} is {got!r}, not {v!r}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root / "check", ignore_errors=True)


# ---- timing helpers ----------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sequence() -> int:
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


class Clock:
    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        sync(self.device)
        dist.barrier()  # every rank starts together (before the sequence number is read)
        self.seq0 = sequence()
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        return time.perf_counter() - self.t0

    def collectives(self) -> int:
        return sequence() - self.seq0


def disk_anchor(root: Path, nbytes: int, rank: int, clock: Clock) -> float:
    """Seconds to write and fsync `nbytes` (every rank at once), as the disk's own speed."""
    block = os.urandom(64 << 20)
    path = root / f"anchor-{rank}.bin"
    clock.start()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, memoryview(block)[:min(left, len(block))])
    os.fsync(fd)
    os.close(fd)
    seconds = clock.lap()
    path.unlink()
    return seconds


# ---- the two contenders --------------------------------------------------------------------------------

def bench_ours(args, state, root: Path, clock: Clock, device) -> dict:
    fields = {"keep_last": 1}
    if args.io_threads:
        fields["io_threads"] = args.io_threads
    out: dict = {"repeat blocking": [], "repeat staged": [], "repeat total": [], "repeat collectives": []}
    ckpt = tc.Checkpointer(root / "ours", **fields)
    clock.start()
    ckpt.save(0, state, blocking=True)
    out["save"], out["save collectives"] = clock.lap(), clock.collectives()
    expected = None
    for i in range(1, 2 + args.repeats):
        change(state)
        expected = snapshot(state)
        clock.start()
        handle = ckpt.save(i, state)
        blocking = clock.lap()
        change(state)  # the trainer goes on at once: its stream is ordered after the staging copies
        handle.wait_staged()
        staged = clock.lap()
        handle.wait()
        total, collectives = clock.lap(), clock.collectives()
        key = "first" if i == 1 else "repeat"
        if key == "first":
            out["first blocking"], out["first total"], out["first collectives"] = blocking, total, collectives
        else:
            out["repeat blocking"].append(blocking)
            out["repeat staged"].append(staged)
            out["repeat total"].append(total)
            out["repeat collectives"].append(collectives)
    target = empty_like(state)
    clock.start()
    ckpt.load(target)
    sync(device)
    out["load"] = clock.lap()
    check(target, expected, "torch-checkpointing")
    del target
    ckpt.close()
    _remove(root / "ours")  # room on the disk for DCP's checkpoints
    return out


def bench_dcp(args, state, root: Path, clock: Clock, device) -> dict:
    from torch.distributed.checkpoint import FileSystemWriter

    def writer(path: Path) -> dict:
        if args.dcp_threads is None:
            return {"checkpoint_id": str(path)}
        return {"storage_writer": FileSystemWriter(str(path), thread_count=args.dcp_threads)}

    out: dict = {"repeat blocking": [], "repeat total": [], "repeat collectives": []}
    clock.start()
    dcp.save(state, **writer(root / "dcp-save"))
    out["save"], out["save collectives"] = clock.lap(), clock.collectives()
    _remove(root / "dcp-save")
    previous = None
    expected = None
    for i in range(1, 2 + args.repeats):
        change(state)
        expected = snapshot(state)
        path = root / f"dcp-async-{i}"
        clock.start()
        response = dcp.async_save(state, **writer(path))
        blocking = clock.lap()
        change(state)  # DCP returns once its CPU copy is done
        future = getattr(response, "upload_completion", response)
        future.result()
        total, collectives = clock.lap(), clock.collectives()
        if i == 1:
            out["first blocking"], out["first total"], out["first collectives"] = blocking, total, collectives
        else:
            out["repeat blocking"].append(blocking)
            out["repeat total"].append(total)
            out["repeat collectives"].append(collectives)
        if previous is not None:
            _remove(previous)
        previous = path
    target = empty_like(state)
    clock.start()
    dcp.load(target, checkpoint_id=str(previous))
    sync(device)
    out["load"] = clock.lap()
    check(target, expected, "DCP")
    _remove(previous)
    return out


def _remove(path: Path) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


# ---- running and reporting -----------------------------------------------------------------------------

def worker(rank: int, world: int, args, root: Path, store_path: str | None) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = {"init_method": f"file://{store_path}"} if store_path else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10), **init)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    correctness_checks(root, device)
    state = make_state(args, rank, world, device)
    nbytes = state_bytes(state)
    clock = Clock(device)
    results = {"bytes": nbytes, "disk": disk_anchor(root, nbytes, rank, clock)}
    results["ours"] = bench_ours(args, state, root, clock, device)
    results["dcp"] = bench_dcp(args, state, root, clock, device)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(args, world, device, gathered)
    dist.destroy_process_group()


def _slowest(values: list, key_path: tuple) -> float:
    """Max over ranks (each rank's value: the median of its repeats)."""
    out = []
    for v in values:
        for k in key_path:
            v = v[k]
        if isinstance(v, list):
            v = sorted(v)[len(v) // 2]
        out.append(v)
    return max(out)


def report(args, world: int, device, gathered: list) -> None:
    total_bytes = sum(g["bytes"] for g in gathered)
    gb = total_bytes / 1e9
    disk = _slowest(gathered, ("disk",))
    rows = []

    def row(name, key, ours_key=None, target=None):
        ours = _slowest(gathered, ("ours", ours_key or key))
        theirs = _slowest(gathered, ("dcp", key))
        ratio = ours / theirs if theirs else float("nan")
        verdict = "" if target is None else ("meets" if ratio <= target else "MISSES") + f" <= {target:.3g}"
        rows.append((name, ours, theirs, ratio, verdict))

    row("blocking save (s)", "save")
    row("first async save: blocking (s)", "first blocking")
    row("first async save: total (s)", "first total")
    row("repeat async save: blocking (s)", "repeat blocking", target=TARGETS["repeat blocking"])
    row("repeat async save: total (s)", "repeat total", target=TARGETS["repeat total"])
    row("load (s)", "load", target=TARGETS["load"])
    staged = _slowest(gathered, ("ours", "repeat staged"))
    print(f"\nstate: {gb:.2f} GB over {world} rank(s) on {device.type}"
          f" ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {args.tensors} tensors;"
          f" torch {torch.__version__}")
    print(f"disk anchor (write + fsync, all ranks at once): {disk:.3f} s = {gb / disk:.2f} GB/s\n")
    print(f"{'':34s} {'torch-ckpt':>11s} {'DCP':>11s} {'ours/DCP':>9s}  target (set for the H200, 8 GiB)")
    for name, ours, theirs, ratio, verdict in rows:
        print(f"{name:34s} {ours:11.4f} {theirs:11.4f} {ratio:9.4f}  {verdict}")
    for label, key in (("collectives: blocking (first) save", "save collectives"),
                       ("collectives: first async save", "first collectives"),
                       ("collectives: repeat async save", "repeat collectives")):
        ours, theirs = _slowest(gathered, ("ours", key)), _slowest(gathered, ("dcp", key))
        print(f"{label:34s} {ours:11.0f} {theirs:11.0f}")
    for label, key in (("write GB/s, repeat async (vs disk)", "repeat total"), ("write GB/s, blocking save (vs disk)", "save")):
        ours, theirs = gb / _slowest(gathered, ("ours", key)), gb / _slowest(gathered, ("dcp", key))
        print(f"{label:34s} {ours:11.2f} {theirs:11.2f}  disk {gb / disk:.2f} GB/s: ours {ours / (gb / disk):.2f}x, DCP {theirs / (gb / disk):.2f}x")
    print(f"{'read GB/s (load)':34s} {gb / _slowest(gathered, ('ours', 'load')):11.2f} {gb / _slowest(gathered, ('dcp', 'load')):11.2f}")
    print(f"(ours: repeat save staged on the host after {staged:.4f} s; the trainer's stream was ordered after the"
          " copies, so it did not wait for that)")
    print("correctness checks passed; every load checked bitwise against the state at save time")
    print(json.dumps({"world": world, "device": device.type, "GB": round(gb, 3), "disk_s": round(disk, 4),
                      **{r[0]: {"ours": round(r[1], 5), "dcp": round(r[2], 5)} for r in rows}}))


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU")
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    need = int(2.2 * args.size_gib * 2**30)  # two steps at a time (the one committing, the one before)
    if free < need:
        raise SystemExit(f"{root} has {free / 2**30:.1f} GiB free; this run needs about {need / 2**30:.1f} GiB (use --dir)")
    try:
        if "WORLD_SIZE" in os.environ:  # torchrun
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, root, None)
        else:
            store = str(root / "pg-store")
            mp.start_processes(worker, args=(args.ranks, args, root, store), nprocs=args.ranks, start_method="spawn")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
