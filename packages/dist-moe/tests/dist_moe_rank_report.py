"""The end of every gloo worker script here (ep_worker.py, balance_loss_worker.py): join the group, write the
rank's report (or its traceback) to OUT_DIR/rank{rank}.json, leave with os._exit; and the rendezvous the
launching test hands its workers (file_rendezvous)."""
from __future__ import annotations

import json
import os
import sys
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path


def file_rendezvous(folder: str | Path) -> str:
    """A file:// init_method naming a file in `folder` that no run used yet.

    A file, not a port picked free and bound later: under pytest -n 15 another test's ranks (often gloo's own
    ephemeral ports) could take that port between the pick and rank 0's bind. A FileStore file must not
    exist before init, so every launch needs a new name."""
    return f"file://{Path(folder).resolve() / f'rendezvous-{uuid.uuid4().hex}'}"


def write_rank_report(rank: int, world: int, init_method: str, out_dir: str, work: Callable[[], dict]) -> None:
    """Run `work()` in a gloo group of `world` ranks met by `init_method` (file_rendezvous) and write what it
    returns; never returns."""
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        report = work()
    except Exception:
        report = {"error": traceback.format_exc()}
        code = 1
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os._exit(code)  # torch sometimes aborts at interpreter exit after gloo
