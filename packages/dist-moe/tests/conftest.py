"""GPU tests use each kernel's first candidate configuration instead of timing every candidate on
first call (the tuner would compile all of them for every test shape); test_expert_mlp.py's
test_every_candidate_on_gpu runs the other candidates. `assert_no_host_sync` names every
host-device synchronisation a CUDA step makes."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch

os.environ.setdefault("DIST_MOE_AUTOTUNE", "0")
# pytest runs with --import-mode=importlib, which does not put test folders on sys.path: the launching tests
# import the workers' shared helper (dist_moe_rank_report, a package-unique name) by this path
sys.path.insert(0, str(Path(__file__).parent))


def _assert_no_host_sync(step: Callable[[], object]) -> None:
    """torch's sync debug mode ('warn') reports each synchronising call as a warning raised at the
    Python line that made it; the failure lists them all (the 'error' mode stops at the first)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # torch words each one "called a synchronizing CUDA operation"; the notice that the debug mode is a
    # prototype is not a synchronisation.
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
             if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
    assert not syncs, "host-device synchronisations:\n" + "\n".join(syncs)


@pytest.fixture
def assert_no_host_sync() -> Callable[[Callable[[], object]], None]:
    return _assert_no_host_sync
