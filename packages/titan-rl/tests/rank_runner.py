"""Starting gloo ranks from test files with the spawn start method, and the file rendezvous they meet by.

pytest imports test files under names a spawned child cannot import, so a rank function is sent by its
file and name and the child loads that file itself (this module is importable in the children because
the test puts this folder on sys.path, which spawn hands on).
"""
from __future__ import annotations

import faulthandler
import importlib.util
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run_from_file(rank: int, path: str, name: str, args: tuple) -> None:
    # a rank that dies of a signal (SIGSEGV) prints every thread's Python stack into the test's output;
    # pytest's own faulthandler covers only its process, not the spawned ranks
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # the machine is shared; one thread per rank also keeps runs reproducible
    spec = importlib.util.spec_from_file_location(f"titan_rl_rank_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, name)(rank, *args)


def spawn_ranks(fn: Callable, nprocs: int, args: tuple) -> None:
    """fn(rank, *args) on `nprocs` spawned processes; fn is a module-level function of a test file."""
    mp.start_processes(_run_from_file, args=(fn.__code__.co_filename, fn.__name__, args), nprocs=nprocs,
                       start_method="spawn")


def file_rendezvous(folder: str | Path) -> str:
    """A file:// init_method naming a file in `folder` that no run used yet.

    A file, not a port picked free and bound later: under pytest -n 15 another test's ranks (often gloo's
    own ephemeral ports) could take that port between the pick and rank 0's bind. A FileStore file must
    not exist before init, so every spawn needs a new name."""
    return f"file://{Path(folder).resolve() / f'rendezvous-{uuid.uuid4().hex}'}"


def join_gloo(rank: int, world: int, init_method: str) -> None:
    """Join the gloo group of `world` ranks met by `init_method`, with torchrun's RANK and WORLD_SIZE set
    (code under test reads them)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
