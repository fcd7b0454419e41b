"""What a checkpoint save costs the trainer, in a training loop: torch-checkpointing against DCP.

A stand-in training loop: each step runs a "forward and backward" (matmuls on work tensors outside
the state, and one small all-reduce that keeps the ranks in step) and then an "optimizer step" that
changes every state tensor in place. A step is timed on the host with the trainer's own stream
synchronised (not the device: a side stream may still be copying). Every `--gap` steps a save is
called at the end of the step, the first `--first-after` steps after the first one (where a path
prepares: torch-checkpointing's reserve()). The trainer cost of a save is the time of that step and
the next minus two steps of the same loop away from saves (their median), the slowest rank's; the
first save and the repeat ones (mean and P99) are reported apart, and how much the steps away from
saves were slowed by the background writes against a loop without saves. Also reported: what the
preparing step cost, what the steps between it and the first save cost together (reserve()'s pinning
runs on a background thread during them), and how long that background allocation took.
`--first-after` defaults to `--gap`, as a trainer whose checkpoint interval is the gap saves;
`--first-after 1` saves at the step right after reserve(), while its pinning is still under way
(the first H200 figure of issue 23, 3.6 s, was measured that way), and the `tc_unreserved` path has
no reserve() at all, so its first save pins the memory itself.
Then, per save path, with nothing else running: one save until durable (write time), and a load
into an empty state, checked bitwise against the state at save time.

    # CPU, 2 gloo ranks (what docs/benchmarks.md records for cpu-2c)
    python tools/bench/checkpoint/bench_checkpoint.py --ranks 2 --size-gib 0.25
    python tools/bench/checkpoint/bench_checkpoint.py --dry-run        # seconds: does it run
    # write speed alone: saves back to back until durable, against the raw disk (buffered and O_DIRECT)
    python tools/bench/checkpoint/bench_checkpoint.py --write-only --ranks 1 --size-gib 1 --saves 4 --paths tc,tc_direct,dcp_pinned
    # a cold load (files evicted from the page cache first) against DCP, beside the disk's own cold reads
    python tools/bench/checkpoint/bench_checkpoint.py --device cuda --ranks 1 --size-gib 8 --write-only --cold-load --saves 3 --paths tc,tc_direct,dcp_pinned
    # one GPU, 8 GiB of state, ~250 ms steps
    python tools/bench/checkpoint/bench_checkpoint.py --device cuda --size-gib 8 --step-ms 250 --dir /local/disk
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raw_disk import raw_read_s, raw_write_s, write_read_file
from save_paths import DESCRIPTIONS, PATHS, local_of, make_path

# (what, path, anchor path, ratio at most) — set for the H200 with 8 GiB of state
TARGETS = [
    ("repeat-save trainer cost (mean)", "tc", "dcp_pinned", 1 / 20),
    ("first-save trainer cost / repeat", "tc", "tc", 2.0),
    ("write (save until durable)", "tc", "dcp_pinned", 0.6),
    ("load", "tc", "dcp_pinned", 0.5),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks on CPU (ignored under torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives (cuda: one GPU per rank)")
    p.add_argument("--size-gib", type=float, default=0.25, help="state size summed over all ranks, GiB")
    p.add_argument("--tensors", type=int, default=64, help="number of state tensors (alternately bf16 and fp32)")
    p.add_argument("--step-ms", type=float, default=None, help="stand-in step time to aim for (default: 60 CPU, 250 GPU)")
    p.add_argument("--gap", type=int, default=12, help="steps from one save to the next")
    p.add_argument("--first-after", type=int, default=None,
                   help="steps from the first one (where a path prepares, e.g. reserve()) to the first save; "
                        "default: --gap, as a trainer checkpointing every gap steps; 1: the next step")
    p.add_argument("--saves", type=int, default=11, help="saves per path: the first and the repeats (>= 10 repeats for a P99)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"save paths to time, of {', '.join(PATHS)}")
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a new folder in the temp dir)")
    p.add_argument("--io-threads", type=int, default=None, help="torch-checkpointing writer threads (default: its own)")
    p.add_argument("--read-threads", type=int, default=None,
                   help="torch-checkpointing reader threads on load (default: its own, min(8, cores)); also the raw read row's")
    p.add_argument("--direct-reads", action="store_true",
                   help="every torch-checkpointing path loads with LocalStorage(direct_reads=True) (O_DIRECT reads into a "
                        "GPU load's pinned buffers; tc_direct does by default): compare with the raw direct read row")
    p.add_argument("--read-chunk-mib", type=float, default=None,
                   help="torch-checkpointing's read size on load, MiB, a power of two (default: its own, 16)")
    p.add_argument("--write-only", action="store_true",
                   help="no training loop: per path, --saves saves one after another, each until durable (the first "
                        "allocates what a path allocates), then a load; reports write times and GB/s against the raw disk")
    p.add_argument("--cold-load", action="store_true",
                   help="evict the saved files from the page cache before the timed load (POSIX_FADV_DONTNEED): a "
                        "load as after a restart; without it a path that wrote through the page cache loads from it "
                        "(tc_direct's direct I/O leaves nothing there); also times the raw disk's cold reads (1 and the "
                        "reader's thread count, buffered and O_DIRECT), the ceiling of a load")
    p.add_argument("--dry-run", action="store_true", help="tiny state, 3 saves, 3-step gaps: checks that every path runs")
    args = p.parse_args()
    if args.dry_run:
        args.size_gib, args.tensors, args.saves, args.gap, args.step_ms = 1 / 256, 8, 3, 3, args.step_ms or 5.0
    args.paths = [name for name in args.paths.split(",") if name]
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        p.error(f"unknown --paths {unknown}; allowed: {', '.join(PATHS)}")
    if args.saves < 2 or args.gap < 2:
        p.error("--saves and --gap must be >= 2 (a first save, a repeat, and a step after each)")
    args.first_after = args.gap if args.first_after is None else args.first_after
    if args.first_after < 1:
        p.error("--first-after must be >= 1 (the first step prepares)")
    return args


# ---- the stand-in trainer --------------------------------------------------------------------------

def make_state(args, rank: int, world: int, device: torch.device) -> dict:
    """`tensors` tensors, alternately bf16 and fp32, about size/world bytes on this rank; with several
    ranks each is a DTensor sharded by rows (made from local data, no collective)."""
    per_rank, cols = int(args.size_gib * 2**30) // world, 1024
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    model = {}
    for i in range(args.tensors):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        rows = max(1, per_rank // args.tensors // (cols * dtype.itemsize))
        local = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32).to(dtype)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard
            local = DTensor.from_local(local, mesh, [Shard(0)], shape=(rows * world, cols), stride=(cols, 1),
                                       run_check=False)
        model[f"layers.{i}.weight" if i % 2 == 0 else f"optim.{i}.exp_avg"] = local
    return {"model": model, "step": 0}


def update(state: dict) -> None:
    """The optimizer step: every state tensor changes in place (queued on the current stream)."""
    for t in state["model"].values():
        local_of(t).add_(1.0)
    state["step"] += 1


def expected_after(args, rank: int, world: int, device: torch.device, steps: int) -> dict:
    """The state after `steps` updates, made again from the seed (independent of any checkpointer)."""
    state = make_state(args, rank, world, device)
    for _ in range(steps):
        update(state)
    return state


class Work:
    """The forward and backward: square matmuls on their own tensors, repeated to last about step_ms."""

    def __init__(self, device: torch.device, step_ms: float):
        self.device = device
        n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
        self.a = torch.randn(n, n, device=device, dtype=dtype) / n**0.5
        self.b = torch.empty_like(self.a)
        self.token = torch.zeros(1)
        self.repeats = 1
        # Warm first: timed cold (library start-up, clocks still low), the matmuls measured 4x slow on the
        # H200, and the loop's steps came out at 58 ms for 250 asked, too short for a save to finish between saves.
        for _ in range(3):
            sync(device)
            began = time.perf_counter()
            for _ in range(20):
                torch.mm(self.a, self.a, out=self.b)
            sync(device)
            per_mm = (time.perf_counter() - began) / 20
        self.repeats = max(1, round(step_ms / 1e3 / per_mm))

    def run(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.a, self.a, out=self.b)
        dist.all_reduce(self.token)  # the ranks stay in step, as a data-parallel trainer's do


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the trainer's stream only, not the staging one


def train_loop(work: Work, state: dict, device, *, steps: int, path=None, save_every: int = 0, first: int = 1):
    """Step times (s); with `path`, prepare after the first step and save every `save_every` steps
    from step `first`. Returns (times, saved steps)."""
    times, saved = [], []
    for i in range(steps):
        began = time.perf_counter()
        work.run()
        if path is not None:
            path.before_update()
        update(state)
        if path is not None and i == 0:
            path.prepare(state)
        if path is not None and i >= first and (i - first) % save_every == 0:
            path.save(state["step"], state)
            saved.append((i, state["step"]))
        sync(device)
        times.append(time.perf_counter() - began)
    return times, saved


def save_costs(times: list[float], saved: list[tuple[int, int]]) -> tuple[list[float], float]:
    """Per save: its step and the next (where the copies overlap the forward and backward, or hold
    them back) minus two steps of the same loop far from any save (the median of the others); and
    that median, which the background writes may slow down."""
    near = {j for i, _ in saved for j in (i, i + 1)}
    steady = statistics.median(t for j, t in enumerate(times) if j not in near and j > 1)
    return [times[i] + times[i + 1] - 2 * steady for i, _ in saved], steady


def prepare_costs(times: list[float], first: int, steady: float, baseline_first: float) -> tuple[float, float]:
    """The preparing step (step 0) against the no-save loop's step 0, and the steps after it up to the
    first save (where a background reservation runs) against the steady step, summed."""
    return times[0] - baseline_first, sum(t - steady for t in times[1:first])


# ---- one path ---------------------------------------------------------------------------------------

def pinning_ms(device) -> tuple[float, int]:
    """Time spent in torch's pinned-memory allocation calls so far (cudaHostAlloc, which holds a driver lock
    that other threads' CUDA calls may wait on), ms, and how many; (0, 0) on CPU or where torch lacks the stats."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats is None:
        return 0.0, 0
    s = stats()
    return s.get("host_alloc_time.total", 0) / 1e3, s.get("num_host_alloc", 0)


def release_cached_pinned_memory(device) -> None:
    """Give the pinned blocks an earlier path freed back to the driver: torch's host allocator caches them,
    and a path after that would get its staging memory without pinning any (its first save flattered)."""
    if device.type == "cuda":
        import gc

        gc.collect()
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or torch._C._host_emptyCache
        empty()


def evict_page_cache(folder: Path) -> None:
    """Drop every file under `folder` from the page cache (clean pages only: the saves were fsynced)."""
    for dirpath, _, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_and_check(args, name: str, path, step: int, rank: int, world: int, device, updates: int,
                   folder: Path) -> float:
    """Load `step` into an empty state (seconds), checked bitwise against the state after `updates` updates."""
    target = make_state(args, rank, world, device)
    for t in target["model"].values():
        local_of(t).zero_()
    sync(device)
    if args.cold_load:
        evict_page_cache(folder)
    dist.barrier()
    began = time.perf_counter()
    path.load(target, step)
    sync(device)
    load = time.perf_counter() - began
    want = expected_after(args, rank, world, device, updates)
    for k, v in want["model"].items():
        if not torch.equal(local_of(target["model"][k]), local_of(v)):
            raise AssertionError(f"{name}: {k} loaded differs from the state at save time")
    return load


def bench_writes(args, name: str, root: Path, rank: int, world: int, device) -> dict:
    """--write-only: `saves` saves back to back, each timed until durable with nothing else running
    (the first also pays what the path allocates at its first save), then a load."""
    release_cached_pinned_memory(device)
    state = make_state(args, rank, world, device)
    path = make_path(name, root / name, device, args)
    path.prepare(state)
    writes = []
    for _ in range(args.saves):
        update(state)
        sync(device)
        dist.barrier()
        began = time.perf_counter()
        path.save(state["step"], state)
        path.before_update()
        path.wait()
        writes.append(time.perf_counter() - began)
        dist.barrier()
    load = load_and_check(args, name, path, state["step"], rank, world, device, state["step"], root / name)
    path.close()
    del state
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / name, ignore_errors=True)
    return {"writes": writes, "load": load}


def bench_path(args, name: str, root: Path, work: Work, rank: int, world: int, device, baseline: tuple) -> dict:
    release_cached_pinned_memory(device)
    pinned_before = pinning_ms(device)
    state = make_state(args, rank, world, device)
    path = make_path(name, root / name, device, args)
    steps = args.first_after + args.gap * args.saves
    times, saved = train_loop(work, state, device, steps=steps, path=path, save_every=args.gap, first=args.first_after)
    costs, steady = save_costs(times, saved)
    prepare_step, before_first = prepare_costs(times, args.first_after, steady, baseline[1])
    reserve_s = getattr(path, "reserve_s", None)
    pinned_after = pinning_ms(device)
    pin_ms, pin_calls = pinned_after[0] - pinned_before[0], pinned_after[1] - pinned_before[1]
    path.wait()
    dist.barrier()
    began = time.perf_counter()
    path.save(state["step"] + 1000, state)  # nothing else running: write time
    path.wait()
    write = time.perf_counter() - began
    dist.barrier()
    load = load_and_check(args, name, path, state["step"] + 1000, rank, world, device, state["step"], root / name)
    path.close()
    del state
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / name, ignore_errors=True)
    return {"first": costs[0], "repeats": costs[1:], "write": write, "load": load, "slowdown": steady / baseline[0] - 1,
            "prepare_step": prepare_step, "before_first": before_first, "reserve_s": reserve_s,
            "pin_ms": pin_ms, "pin_calls": pin_calls}


# ---- running and reporting -----------------------------------------------------------------------------

def worker(rank: int, world: int, args, root: Path, store_path: str | None) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = {"init_method": f"file://{store_path}"} if store_path else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10), **init)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    state = make_state(args, rank, world, device)
    nbytes = sum(local_of(t).numel() * local_of(t).element_size() for t in state["model"].values())
    work, results, first_step = None, {"bytes": nbytes, "baseline": 0.0, "paths": {}}, 0.0
    if not args.write_only:
        work = Work(device, args.step_ms or (250.0 if device.type == "cuda" else 60.0))
        base_times, _ = train_loop(work, state, device, steps=max(20, 2 * args.gap))
        results["baseline"] = statistics.median(base_times[2:])
        first_step = base_times[0]  # a loop's step 0 (cold effects), what a preparing step 0 is compared with
    del state
    results["raw"] = raw_disk(args, root, rank, nbytes)
    results["raw_read"] = raw_reads(args, root, rank, nbytes) if args.cold_load else {}
    if rank == 0:
        print(f"step without saves: {results['baseline'] * 1e3:.1f} ms; timing {', '.join(args.paths)}", flush=True)
    summary = summarize_writes if args.write_only else summarize
    for name in args.paths:
        began = time.perf_counter()
        try:
            if args.write_only:
                results["paths"][name] = bench_writes(args, name, root, rank, world, device)
            else:
                results["paths"][name] = bench_path(args, name, root, work, rank, world, device,
                                                    (results["baseline"], first_step))
        except Exception as e:  # a DCP mode that does not run here: say so, time the others
            results["paths"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        dist.barrier()
        row: list = [None] * world  # each path's figures as soon as it ends: a run cut short keeps them
        dist.all_gather_object(row, {"paths": {name: results["paths"][name]}})
        if rank == 0:
            print(f"  {name}: done in {time.perf_counter() - began:.1f} s: {summary(row, name)}", flush=True)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (report_writes if args.write_only else report)(args, world, device, work, gathered)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch sometimes aborts at exit after gloo


def raw_threads(args) -> int:
    """torch-checkpointing's writer's thread count (the raw rows' parallel streams)."""
    import torch_checkpointing as tc
    return args.io_threads or tc.CheckpointerConfig().io_threads


def raw_modes(threads: int, rank: int, what: str, measure) -> dict[str, float | None]:
    """measure(streams, direct) -> seconds, buffered with 1 stream and with `threads`, direct with `threads`,
    every rank at once; None where the mode failed here (O_DIRECT refused)."""
    out: dict[str, float | None] = {}
    for label, n, direct in (("buffered x1", 1, False), (f"buffered x{threads}", threads, False),
                             (f"direct x{threads}", threads, True)):
        dist.barrier()
        try:
            out[label] = measure(n, direct)
        except OSError as e:  # O_DIRECT refused by this filesystem
            print(f"{what} {label} failed on rank {rank}: {e}", flush=True)
            out[label] = None
    return out


def raw_disk(args, root: Path, rank: int, nbytes: int) -> dict[str, float | None]:
    """This rank's bytes written raw (raw_disk.py): buffered with 1 thread and with the writer's thread
    count, and direct with the writer's count; every rank at once. Seconds (None: the mode failed here)."""
    out = raw_modes(raw_threads(args), rank, "raw disk",
                    lambda n, direct: raw_write_s(root / f"raw-disk-{rank}", nbytes, n, direct=direct))
    dist.barrier()
    if rank == 0:
        print("raw disk: " + ", ".join(f"{k} {v:.3f} s" if v else f"{k} failed" for k, v in out.items()), flush=True)
    return out


def raw_reads(args, root: Path, rank: int, nbytes: int) -> dict[str, float | None]:
    """--cold-load: this rank's bytes read raw from the disk (raw_disk.py), the ceiling of a cold load:
    buffered with 1 thread and with the reader's thread count, direct with the reader's count; every rank at once."""
    import torch_checkpointing as tc
    threads = args.read_threads or tc.CheckpointerConfig().read_threads
    path = root / f"raw-read-{rank}" / "raw.bin"
    write_read_file(path, nbytes, threads)
    out = raw_modes(threads, rank, "raw read", lambda n, direct: raw_read_s(path, n, direct=direct))
    shutil.rmtree(path.parent, ignore_errors=True)
    dist.barrier()
    if rank == 0:
        print("raw disk read (cold): " + ", ".join(f"{k} {v:.3f} s" if v else f"{k} failed" for k, v in out.items()),
              flush=True)
    return out


def report_raw_reads(raw: dict[str, float | None], rows: dict, gb: float) -> None:
    """--cold-load: the raw read rows, each torch-checkpointing path's load beside the best, and whether the
    load target (<= 0.5x pinned DCP) is reachable at all: a disk that alone needs more cannot meet it."""
    report_raw_rows(raw, rows, gb, metric="load", row="raw read ",
                    method="raw read: the same bytes, one file evicted from the page cache, 16 MiB reads",
                    disk_verb="reads in", by="a reader", speed_of="tc")


def gathered_raw(gathered: list, key: str = "raw") -> dict[str, float | None]:
    """Per raw mode, the slowest rank's seconds (None where a rank could not run it)."""
    out = {}
    for label in gathered[0][key]:
        values = [g[key][label] for g in gathered]
        out[label] = None if any(v is None for v in values) else max(values)
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _rank_results(gathered: list, name: str) -> list[dict] | dict | None:
    """Each rank's results for one path; None where a rank has none, {"error": ...} where one failed."""
    per_rank = [g["paths"].get(name) for g in gathered]
    if any(p is None for p in per_rank):
        return None
    errors = [p["error"] for p in per_rank if "error" in p]
    return {"error": errors[0]} if errors else per_rank


def summarize(gathered: list, name: str) -> dict | None:
    """Slowest rank's figures for one path (per save: the max over ranks)."""
    per_rank = _rank_results(gathered, name)
    if not isinstance(per_rank, list):
        return per_rank
    repeats = [max(p["repeats"][i] for p in per_rank) for i in range(len(per_rank[0]["repeats"]))]
    reserve = [p["reserve_s"] for p in per_rank if p.get("reserve_s") is not None]
    return {"first": max(p["first"] for p in per_rank), "mean": statistics.fmean(repeats), "p99": _p99(repeats),
            "slowdown": max(p["slowdown"] for p in per_rank), "prepare_step": max(p["prepare_step"] for p in per_rank),
            "before_first": max(p["before_first"] for p in per_rank), "reserve_s": max(reserve) if reserve else -1.0,
            "pin_ms": max(p["pin_ms"] for p in per_rank), "pin_calls": max(p["pin_calls"] for p in per_rank),
            "write": max(p["write"] for p in per_rank), "load": max(p["load"] for p in per_rank), "n": len(repeats)}


def report(args, world: int, device, work: Work, gathered: list) -> None:
    gb = sum(g["bytes"] for g in gathered) / 1e9
    baseline = max(g["baseline"] for g in gathered)
    rows = {name: summarize(gathered, name) for name in args.paths}
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"\nstate: {gb:.3f} GB over {world} rank(s) on {device.type} ({machine}), {args.tensors} tensors; "
          f"torch {torch.__version__}; step without saves {baseline * 1e3:.1f} ms ({work.repeats} matmuls); "
          f"a save every {args.gap} steps, the first {args.first_after} after the preparing step")
    print("trainer cost of a save = its step and the next, minus two steps of the same loop away from saves;"
          " other steps: how much slower those were than steps without any saves (background writes)\n")
    print(f"{'path':14s} {'first (ms)':>11s} {'repeat mean':>12s} {'repeat P99':>11s} {'n':>3s} {'other steps':>12s}"
          f" {'write (s)':>10s} {'GB/s':>6s} {'load (s)':>9s} {'prep step':>10s} {'to 1st save':>12s} {'reserve bg':>11s}")
    for name, r in rows.items():
        if r is None or "error" in r:
            print(f"{name:14s} did not run: {r['error'] if r else 'missing'}")
            continue
        reserve = f"{r['reserve_s']:10.3f}s" if r["reserve_s"] >= 0 else f"{'-':>11s}"
        print(f"{name:14s} {r['first'] * 1e3:11.1f} {r['mean'] * 1e3:12.1f} {r['p99'] * 1e3:11.1f} {r['n']:3d}"
              f" {r['slowdown'] * 100:+11.1f}% {r['write']:10.3f} {gb / r['write']:6.2f} {r['load']:9.3f} {r['prepare_step'] * 1e3:8.1f}ms"
              f" {r['before_first'] * 1e3:10.1f}ms {reserve}")
    raw = gathered_raw(gathered)
    report_raw(raw, rows, gb)
    raw_read = gathered_raw(gathered, "raw_read")
    report_raw_reads(raw_read, rows, gb)
    print("prep step: the preparing step against the no-save loop's first step; to 1st save: the steps between it and"
          " the first save against the steady step, summed (reserve()'s background pinning runs then); reserve bg:"
          " how long that allocation took (the first save waits for what is left of it)")
    if device.type == "cuda":
        print("pinned allocation during the loop (torch.cuda.host_memory_stats): "
              + "; ".join(f"{name} {r['pin_ms']:.0f} ms in {r['pin_calls']} calls" for name, r in rows.items()
                          if r is not None and "error" not in r))
    print()
    for name in args.paths:
        print(f"  {name}: {DESCRIPTIONS[name]}")
    print("\nratios (targets set for the H200 with 8 GiB):")
    keys = {"repeat-save trainer cost (mean)": ("mean", "mean"), "first-save trainer cost / repeat": ("first", "mean"),
            "write (save until durable)": ("write", "write"), "load": ("load", "load")}
    for what, ours, anchor, target in TARGETS:
        a, b = rows.get(ours), rows.get(anchor)
        if not a or not b or "error" in a or "error" in b:
            print(f"  {what}: {ours} or {anchor} not timed")
            continue
        num, den = a[keys[what][0]], b[keys[what][1]]
        ratio = num / den if den > 0 else float("inf")
        verdict = "meets" if ratio <= target else "MISSES"
        print(f"  {what}: {ours} / {anchor} = {ratio:.4f}  ({verdict} <= {target:.3g})")
    print("(a cost at or under 0 is within the step-time noise; every load was checked bitwise)")
    print(json.dumps({"world": world, "device": device.type, "GB": round(gb, 4), "baseline_ms": round(baseline * 1e3, 2),
                      "raw_disk_write_s": {t: x and round(x, 5) for t, x in raw.items()},
                      "raw_disk_read_s": {t: x and round(x, 5) for t, x in raw_read.items()},
                      "paths": {k: ({m: round(x, 5) for m, x in v.items()} if v and "error" not in v else v)
                                for k, v in rows.items()}}))


def report_raw(raw: dict[str, float | None], rows: dict, gb: float) -> None:
    """The raw-disk rows, each path's write speed beside them (GB/s, and as a fraction of the disk's best),
    and whether the write target can be met at all: if the disk alone needs more than the target allows,
    no writer meets it."""
    report_raw_rows(raw, rows, gb, metric="write", row="raw disk ",
                    method="raw: the same bytes, 4 MiB writes + fsync, one file per thread", disk_verb="takes",
                    by="a writer")


def report_raw_rows(raw: dict[str, float | None], rows: dict, gb: float, *, metric: str, row: str, method: str,
                    disk_verb: str, by: str, speed_of: str = "") -> None:
    """The raw rows, the `metric` speed of each path whose name starts with `speed_of` against the best of
    them, and per target of that metric (TARGETS) whether the disk alone leaves it reachable."""
    timed = {k: v for k, v in raw.items() if v}
    for label, seconds in raw.items():
        what = f"{seconds:.3f} s, {gb / seconds:.2f} GB/s" if seconds else "failed (O_DIRECT refused?)"
        print(f"{row + label:24s} {what}")
    if not timed:
        return
    best_label = min(timed, key=timed.get)
    best = timed[best_label]
    print(f"({method}; best: {best_label})")
    paths = [(name, r) for name, r in rows.items() if name.startswith(speed_of) and r and "error" not in r]
    print(f"{metric} speed: " + "; ".join(
        f"{name} {gb / r[metric]:.2f} GB/s = {best / r[metric] * 100:.0f}% of the raw best" for name, r in paths))
    for what, ours, anchor, target in TARGETS:
        a = rows.get(anchor)
        if what.startswith(metric) and a and "error" not in a:
            allowed = target * a[metric]
            verdict = "reachable" if best <= allowed else f"NOT reachable by {by}: the disk alone needs more"
            print(f"{metric} target: {ours} <= {target:.3g} x {anchor} ({a[metric]:.3f} s) = {allowed:.3f} s;"
                  f" the raw disk {disk_verb} {best:.3f} s ({best / a[metric]:.2f}x {anchor}): {verdict}")


def summarize_writes(gathered: list, name: str) -> dict | None:
    """--write-only: the slowest rank's write per save; "write" = the median of the saves after the first."""
    per_rank = _rank_results(gathered, name)
    if not isinstance(per_rank, list):
        return per_rank
    writes = [max(p["writes"][i] for p in per_rank) for i in range(len(per_rank[0]["writes"]))]
    return {"first": writes[0], "write": statistics.median(writes[1:]), "min": min(writes[1:]),
            "max": max(writes[1:]), "n": len(writes) - 1, "load": max(p["load"] for p in per_rank)}


def report_writes(args, world: int, device, work, gathered: list) -> None:
    gb = sum(g["bytes"] for g in gathered) / 1e9
    rows = {name: summarize_writes(gathered, name) for name in args.paths}
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    nodes = len([n for n in os.listdir("/sys/devices/system/node") if n.startswith("node")]) \
        if os.path.isdir("/sys/devices/system/node") else "?"
    print(f"\nstate: {gb:.3f} GB over {world} rank(s) on {device.type} ({machine}, {nodes} NUMA node(s)), "
          f"{args.tensors} tensors; torch {torch.__version__}; --write-only: {args.saves} saves per path back to back, "
          f"each until durable, nothing else running; load {'cold (files evicted from the page cache)' if args.cold_load else 'as left by the save'}\n")
    print(f"{'path':14s} {'first (s)':>10s} {'write median (s)':>17s} {'min':>7s} {'max':>7s} {'n':>3s} {'GB/s':>6s}"
          f" {'load (s)':>9s}")
    for name, r in rows.items():
        if r is None or "error" in r:
            print(f"{name:14s} did not run: {r['error'] if r else 'missing'}")
            continue
        print(f"{name:14s} {r['first']:10.3f} {r['write']:17.3f} {r['min']:7.3f} {r['max']:7.3f} {r['n']:3d}"
              f" {gb / r['write']:6.2f} {r['load']:9.3f}")
    raw = gathered_raw(gathered)
    report_raw(raw, rows, gb)
    raw_read = gathered_raw(gathered, "raw_read")
    report_raw_reads(raw_read, rows, gb)
    print()
    for name in args.paths:
        print(f"  {name}: {DESCRIPTIONS[name]}")
    print("\nratios (targets set for the H200 with 8 GiB; write = the median repeat save):")
    ours_all = [name for name in args.paths if name.startswith("tc")]  # every torch-checkpointing path timed
    for what, _, anchor, target in TARGETS:
        key = {"write (save until durable)": "write", "load": "load"}.get(what)
        b = rows.get(anchor)
        if key is None:
            continue
        for ours in ours_all:
            a = rows.get(ours)
            if not a or not b or "error" in a or "error" in b:
                print(f"  {what}: {ours} or {anchor} not timed")
                continue
            ratio = a[key] / b[key] if b[key] > 0 else float("inf")
            print(f"  {what}: {ours} / {anchor} = {ratio:.4f}  ({'meets' if ratio <= target else 'MISSES'} <= {target:.3g})")
    print("(every load was checked bitwise)")
    print(json.dumps({"world": world, "device": device.type, "GB": round(gb, 4), "write_only": True,
                      "raw_disk_write_s": {t: x and round(x, 5) for t, x in raw.items()},
                      "raw_disk_read_s": {t: x and round(x, 5) for t, x in raw_read.items()},
                      "paths": {k: ({m: round(x, 5) for m, x in v.items()} if v and "error" not in v else v)
                                for k, v in rows.items()}}))


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU")
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    need = int(3.3 * args.size_gib * 2**30)  # up to three steps of one path at a time
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
