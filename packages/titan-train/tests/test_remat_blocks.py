"""tools/bench/exec_layer/remat_blocks.py: a mixed plan's per-block memory against the planner's prediction. On
the GPU (skipped on CPU): compiled 8B blocks, the CUDA allocator's figures within 5% of the plan's. On CPU: the
script's accounting (saved bytes from the allocator's growth, high marks between gradient hooks) on an allocator
faked by a live-storage count, eager fp32 debug blocks, against the planner."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools/bench/exec_layer"))
import remat_blocks  # noqa: E402

MIXED = "save_matmuls_attention,save_attention,recompute,keep"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures the CUDA allocator: needs a CUDA GPU")
def test_compiled_mixed_plan_blocks_peak_as_planned_on_the_gpu(capsys):
    rc = remat_blocks.main(["--layers", "4", "--batch", "1", "--plan", MIXED, "--check"])
    print(capsys.readouterr().out)
    assert rc == 0


class FakeAllocator(TorchDispatchMode):
    """Live bytes of the storages ops make, and their high mark since the last reset: torch.cuda's stats."""

    def __init__(self):
        super().__init__()
        self.refs, self.high = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
            if ptr and (ptr not in self.refs or self.refs[ptr][0].expired()):
                self.refs[ptr] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.high = max(self.high, self.allocated())
        return out

    def allocated(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def reset(self):
        self.high = self.allocated()


def test_the_bench_accounting_on_a_faked_allocator(monkeypatch, capsys):
    fake = FakeAllocator()
    for name, fn in {"is_available": lambda: True, "memory_allocated": fake.allocated,
                     "max_memory_allocated": lambda: max(fake.high, fake.allocated()),
                     "reset_peak_memory_stats": fake.reset, "synchronize": lambda: None,
                     "empty_cache": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(remat_blocks, "DEVICE", "cpu")
    build = remat_blocks.build
    # CPU: fp32
    monkeypatch.setattr(remat_blocks, "build", lambda layers, flavor, fused=False: build(layers, flavor, fused).float())
    seen = {}

    def fp32_choices(model, plan, rows, seq, compiled):
        from titan_train.remat import profile_blocks
        from titan_train.remat.plan import OPTIONS, choose

        profiles = profile_blocks(model, rows=rows, seq_len=seq, dtype=torch.float32, compiled=compiled)
        seen["choices"] = [choose(p, o, OPTIONS[o]) for p, o in zip(profiles, plan, strict=True)]
        return seen["choices"]

    monkeypatch.setattr(remat_blocks, "planner_choices", fp32_choices)
    measured = {}
    run_pass = remat_blocks.run_pass

    def recording(*args):  # the second pass (after the warm-up) is the measured one
        measured["last"] = run_pass(*args)
        return measured["last"]

    monkeypatch.setattr(remat_blocks, "run_pass", recording)
    with fake:
        rc = remat_blocks.main(["--flavor", "debug", "--layers", "4", "--seq", "64", "--batch", "4", "--eager",
                                "--plan", MIXED, "--check"])
    assert rc == 0, capsys.readouterr().out
    saved = measured["last"]["saved"]
    assert saved == pytest.approx([c.saved_bytes for c in seen["choices"]], rel=0.02)
    assert saved[3] > saved[0] > saved[1] > saved[2] > 0  # keep > matmuls and attention > attention > input
