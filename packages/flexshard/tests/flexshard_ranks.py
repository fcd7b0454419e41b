"""`run_ranks`: run a test function on N gloo ranks in fresh processes and collect what each returns.

A module of its own name (not conftest): pytest runs every package's tests in one session, where
`import conftest` would find whichever package's conftest.py came first on sys.path.

Workers are plain subprocesses running rank_main.py (pytest imports test files under names a
spawned child could not import), with OMP_NUM_THREADS=1; a failing rank's traceback is raised here.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

RANK_MAIN = Path(__file__).with_name("rank_main.py")


def file_rendezvous(folder: str | Path) -> str:
    """A file:// init_method naming a file in `folder` that no run used yet.

    A file, not a port picked free and bound later: under pytest -n 15 another test's ranks (often gloo's
    own ephemeral ports) could take that port between the pick and rank 0's bind. A FileStore file must
    not exist before init, so every run needs a new name."""
    return f"file://{Path(folder).resolve() / f'rendezvous-{uuid.uuid4().hex}'}"


def run_ranks(fn, world: int = 2, timeout: float = 300.0, backend: str = "gloo", **kwargs) -> list:
    """fn(rank, world, **kwargs) on `world` ranks (gloo; nccl: one GPU per rank); returns [result of rank 0, ...]."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "kwargs.pkl").write_bytes(pickle.dumps(kwargs))
        init_method = file_rendezvous(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = [
            subprocess.Popen(
                [sys.executable, str(RANK_MAIN), fn.__code__.co_filename, fn.__name__, str(rank), str(world), init_method, str(tmp), backend],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout
        outputs = [""] * world
        try:
            for rank, p in enumerate(procs):
                outputs[rank], _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{fn.__name__} on {world} ranks timed out after {timeout}s")
        if os.environ.get("FLEXSHARD_TEST_VERBOSE"):
            for r, text in enumerate(outputs):
                print(f"--- rank {r} output ---\n{text}")
        errors = [
            f"--- rank {r} (exit {p.returncode}) ---\n{(tmp / f'{r}.err').read_text() if (tmp / f'{r}.err').exists() else outputs[r][-4000:]}"
            for r, p in enumerate(procs)
            if p.returncode != 0 or not (tmp / f"{r}.pkl").exists()
        ]
        if errors:
            pytest.fail(f"{fn.__name__} failed on {len(errors)} of {world} ranks:\n" + "\n".join(errors), pytrace=False)
        return [pickle.loads((tmp / f"{r}.pkl").read_bytes()) for r in range(world)]
