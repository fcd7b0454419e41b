"""reserve(): the first save stages into memory allocated before it, and writes what an unreserved save writes.

Expected tensors are the test's own clones (or read back by the safetensors library); what a save
writes with a reservation is compared byte for byte with what it writes without one.
"""
from __future__ import annotations

import json
import threading

import pytest
import safetensors.torch
import torch

import torch_checkpointing as tc
import torch_checkpointing.staging as staging
from ckpt_spawn import run_ranks
from ckpt_workers import reserve_on_two

SLAB = 64 << 10  # small slabs: a few hundred KB of state spans several


def make_state(seed: int, rows: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(rows, 100, generator=g), "b": torch.randn(77, 5, generator=g).bfloat16(),
                      "t": torch.randn(300, 7, generator=g).t(), "i": torch.arange(seed, seed + 9)},
            "step": seed, "blob": bytes([seed]) * 5}


def clone(state: dict) -> dict:
    return {k: clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def empty_like(state: dict) -> dict:
    return {k: empty_like(v) if isinstance(v, dict) else torch.full_like(v, 0) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            assert_equal(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def step_bytes(folder, step: int) -> dict[str, bytes]:
    """Every file of a committed step; commit.json without the time it was written (and its checksum)."""
    out = {}
    for path in sorted((folder / f"step-{step}").iterdir()):
        out[path.name] = path.read_bytes()
    commit = json.loads((folder / f"step-{step}" / "commit.json").read_text())
    out["commit.json"] = {k: v for k, v in commit.items() if k not in ("committed_at", "crc32")}
    return out


class SlowReservation:
    """HostPool.take held back on the reservation's thread (its `touch=True` call) until released."""

    def __init__(self, monkeypatch, *, fail: bool = False):
        self.release, self.fail, self.reserved_slabs = threading.Event(), fail, None
        real_take = staging.HostPool.take

        def take(pool, *args, **kwargs):
            if kwargs.get("touch"):
                assert self.release.wait(30)
                if self.fail:
                    raise RuntimeError("cudaHostAlloc: out of memory (injected)")
                self.reserved_slabs = [s.data_ptr() for s in real_take(pool, *args, **kwargs)]
                return pool.slabs
            return real_take(pool, *args, **kwargs)

        monkeypatch.setattr(staging.HostPool, "take", take)


def test_reserved_saves_write_the_bytes_unreserved_ones_do(tmp_path):
    for name in ("reserved", "unreserved"):
        state = make_state(1)
        with tc.Checkpointer(tmp_path / name, slab_bytes=SLAB, block_bytes=4096) as ckpt:
            if name == "reserved":
                ckpt.reserve(state).result()
            ckpt.save(1, state, manual_release=True).wait()   # the first save: into the reserved slabs
            state["model"]["w"].add_(1.0)
            ckpt.save(2, state).wait()                        # a repeat, into the same slabs
    for step in (1, 2):
        reserved, unreserved = step_bytes(tmp_path / "reserved", step), step_bytes(tmp_path / "unreserved", step)
        assert reserved.keys() == unreserved.keys() and len(reserved) >= 4
        for name in reserved:
            assert reserved[name] == unreserved[name], (step, name)
    # and those bytes are the state's (read by the safetensors library, not by torch_checkpointing)
    stored = safetensors.torch.load_file(tmp_path / "reserved" / "step-1" / "rank-00000.safetensors")
    want = make_state(1)["model"]
    assert torch.equal(stored["model.w"], want["w"]) and torch.equal(stored["model.t"], want["t"])
    assert not torch.equal(stored["model.w"], safetensors.torch.load_file(
        tmp_path / "reserved" / "step-2" / "rank-00000.safetensors")["model.w"])  # (a control: step 2 differs)


def test_a_save_during_an_unfinished_reservation_waits_for_it_and_is_correct(tmp_path, monkeypatch):
    slow = SlowReservation(monkeypatch)
    state = make_state(2)
    with tc.Checkpointer(tmp_path, slab_bytes=SLAB, block_bytes=4096) as ckpt:
        reservation = ckpt.reserve(state)
        threading.Timer(0.3, slow.release.set).start()
        assert not reservation.done()  # the save below comes before the memory is ready
        expected = clone(state)
        handle = ckpt.save(1, state, manual_release=True)
        assert reservation.done()
        handle.order_current_stream()
        state["model"]["w"].mul_(-1.0)  # the "optimizer step" right after: must not reach the checkpoint
        state["model"]["i"].add_(5)
        handle.wait()
        assert [s.data_ptr() for s in ckpt._pool.slabs] == slow.reserved_slabs  # staged into the reserved slabs
        target = empty_like(expected)
        assert ckpt.load(target, step=1) == 1
    assert_equal(target, expected)


def test_a_state_whose_shapes_changed_after_reserve_is_planned_anew(tmp_path):
    """Re-planned, not refused: the reserved slabs are reused and only the missing ones allocated."""
    small = make_state(3, rows=1000)
    with tc.Checkpointer(tmp_path, slab_bytes=SLAB, block_bytes=4096) as ckpt:
        ckpt.reserve(small).result()
        reserved = [s.data_ptr() for s in ckpt._pool.slabs]
        grown = make_state(4, rows=2500)
        grown["model"]["new"] = torch.randn(40, 40)
        expected = clone(grown)
        ckpt.save(1, grown).wait()
        slabs = [s.data_ptr() for s in ckpt._pool.slabs]
        assert len(slabs) > len(reserved) and slabs[:len(reserved)] == reserved
        ckpt.save(2, small).wait()  # and back to the reserved layout
        grown_target, small_target = empty_like(expected), empty_like(small)
        ckpt.load(grown_target, step=1)
        ckpt.load(small_target, step=2)
    assert_equal(grown_target, expected)
    assert_equal(small_target, make_state(3, rows=1000))


def test_a_failed_reservation_warns_and_the_save_allocates(tmp_path, monkeypatch):
    slow = SlowReservation(monkeypatch, fail=True)
    state = make_state(5)
    with tc.Checkpointer(tmp_path, slab_bytes=SLAB, block_bytes=4096) as ckpt:
        ckpt.reserve(state)
        slow.release.set()
        with pytest.warns(RuntimeWarning, match=r"out of memory \(injected\)\); the save allocates it"):
            ckpt.save(1, state).wait()
        target = empty_like(state)
        ckpt.load(target)
    assert_equal(target, make_state(5))


def test_reserve_on_two_ranks(tmp_path):
    """gloo: reserve() runs the layout exchange (the only collectives), a save during the unfinished
    reservation and a save whose layout grew run none; both load back; the reserved run's files equal
    an unreserved run's."""
    run_ranks(2, tmp_path / "pg", reserve_on_two, str(tmp_path))
    for step in (1, 2):
        reserved, unreserved = step_bytes(tmp_path / "reserved", step), step_bytes(tmp_path / "unreserved", step)
        assert reserved.keys() == unreserved.keys() and len(reserved) >= 6
        for name in reserved:
            assert reserved[name] == unreserved[name], (step, name)


def test_a_state_smaller_than_a_slab_gets_a_slab_of_its_size(tmp_path):
    """A 4 KB state does not reserve (allocate, touch, on a GPU pin) a whole 256 MiB slab; a larger state
    later gets full slabs, and the small one then reuses them instead of allocating again."""
    small, large = {"w": torch.randn(1000)}, {"w": torch.randn(200_000)}  # 4 KB; 800 KB
    with tc.Checkpointer(tmp_path, slab_bytes=256 << 10, block_bytes=4096) as ckpt:
        ckpt.reserve(small).result()
        assert [s.numel() for s in ckpt._pool.slabs] == [4096]
        ckpt.save(1, small).wait()
        ckpt.save(2, large).wait()
        slabs = [s.data_ptr() for s in ckpt._pool.slabs]
        assert [s.numel() for s in ckpt._pool.slabs] == [256 << 10] * 4
        ckpt.save(3, small).wait()
        assert [s.data_ptr() for s in ckpt._pool.slabs] == slabs
        targets = {step: {"w": torch.zeros_like(v["w"])} for step, v in ((1, small), (2, large), (3, small))}
        for step, target in targets.items():
            ckpt.load(target, step=step)
    assert torch.equal(targets[1]["w"], small["w"]) and torch.equal(targets[3]["w"], small["w"])
    assert torch.equal(targets[2]["w"], large["w"])
