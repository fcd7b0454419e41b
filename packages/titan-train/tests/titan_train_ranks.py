"""Starting gloo ranks from test files with the spawn start method.

Spawn, not fork: a child forked from a process where autograd already ran (an earlier test of the
session, or this test's single-process reference run) cannot run autograd ("Unable to handle
autograd's threading in combination with fork-based multiprocessing"). pytest imports test files
under --import-mode=importlib, with module names a spawned child cannot import, so a rank function
is sent by its file and name and the child loads that file itself. This module is importable by name
in the children because conftest.py puts this folder on sys.path, which spawn hands on.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import os
import uuid
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp


def _run_from_file(rank: int, path: str, name: str, args: tuple) -> None:
    # a rank that dies of a signal (SIGSEGV) prints every thread's Python stack into the test's output;
    # pytest's own faulthandler covers only its process, not the spawned ranks
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)  # the machine is shared; one thread per rank also keeps runs reproducible
    spec = importlib.util.spec_from_file_location(f"titan_train_rank_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, name)(rank, *args)


def spawn_ranks(fn: Callable, nprocs: int, args: tuple) -> None:
    """fn(rank, *args) on `nprocs` spawned processes; fn is a module-level function of a test file."""
    assert fn.__qualname__ == fn.__name__, f"{fn.__qualname__}: only module-level functions can be sent by name"
    mp.start_processes(_run_from_file, args=(fn.__code__.co_filename, fn.__name__, args), nprocs=nprocs,
                       start_method="spawn")


def file_rendezvous(folder: str | Path) -> str:
    """A file:// init_method naming a file in `folder` that no run used yet.

    A file, not a port picked free and bound later: under pytest -n 15 another test's ranks (often
    gloo's own ephemeral ports) could take that port between the pick and rank 0's bind. A FileStore
    file must not exist before init, so every group (every spawn, every re-init) needs a new name."""
    return f"file://{Path(folder).resolve() / f'rendezvous-{uuid.uuid4().hex}'}"


def join_gloo(rank: int, world: int, init_method: str) -> None:
    """Join the gloo group of `world` ranks the way the trainer does: torchrun's RANK, WORLD_SIZE and
    LOCAL_RANK, and TITAN_INIT_METHOD (titan_train.process_group) for the rendezvous."""
    from titan_train.process_group import init_process_group_from_env

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TITAN_INIT_METHOD=init_method)
    init_process_group_from_env("gloo")
