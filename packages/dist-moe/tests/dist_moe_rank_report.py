"""The end of every gloo worker script here (ep_worker.py, balance_loss_worker.py): join the group, write the
rank's report (or its traceback) to OUT_DIR/rank{rank}.json, leave with os._exit."""
from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def write_rank_report(rank: int, world: int, port: str, out_dir: str, work: Callable[[], dict]) -> None:
    """Run `work()` in a gloo group of `world` ranks and write what it returns; never returns."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
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
