"""Running a function on N gloo ranks (torch.multiprocessing spawn), with errors brought home."""
from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, workdir: str, fn: Callable, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/pg-store-{world_size}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),  # a rank that died must not hang the others for 30 min
    )
    code = 0
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears the group down while others still use it
    except BaseException:
        Path(workdir, f"error-rank{rank}.txt").write_text(traceback.format_exc())
        code = 1
    finally:
        if code == 0:
            dist.destroy_process_group()
        os._exit(code)  # torch sometimes aborts at interpreter exit otherwise


def run_ranks(world_size: int, workdir: Path, fn: Callable, *args, timeout_s: float = 150.0) -> None:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; re-raises any rank's error.

    The ranks are spawned, not forked: a child forked from a process where autograd already ran (an
    earlier test in the same session) cannot run autograd ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing"). `fn` must live in a module importable by name from
    this folder (ckpt_workers.py; conftest.py puts the folder on sys.path, which spawn hands to the
    children): pytest imports test files under names a child could not import.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in workdir.glob("error-rank*.txt"):
        stale.unlink()
    context = mp.start_processes(
        _entry, args=(world_size, str(workdir), fn, args), nprocs=world_size, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout_s:.0f} s")
    except mp.ProcessExitedException as e:
        errors = sorted(workdir.glob("error-rank*.txt"))
        detail = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in errors)
        raise AssertionError(f"a rank failed:\n{detail or e}") from None
