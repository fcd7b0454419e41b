"""CUDA staging and loading: pinned slabs reused, side-stream copies ordered before later changes."""
from __future__ import annotations

import pytest
import torch

import torch_checkpointing as tc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA staging and loading need a GPU")


def gpu_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, 1024, device="cuda", generator=g)
    return {"x": x, "t": torch.randn(512, 300, device="cuda", generator=g).t(), "b": x[:100].bfloat16(),
            "i": torch.arange(10, device="cuda"), "cpu": torch.ones(3), "step": 3}


def test_save_is_ordered_before_later_changes_and_loads_back(tmp_path):
    state = gpu_state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with tc.Checkpointer(tmp_path, slab_bytes=1 << 20, block_bytes=1 << 16) as ckpt:  # many slabs, many events
        for step in (1, 2):
            handle = ckpt.save(step, state)
            slabs = [s.data_ptr() for s in ckpt._pool.slabs]
            assert all(s.is_pinned() for s in ckpt._pool.slabs)
            for v in state.values():  # queued on the current stream: must run after the copies
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.mul_(0)
            handle.wait()
            for k, v in expected.items():
                if isinstance(v, torch.Tensor):
                    state[k].copy_(v)
        assert [s.data_ptr() for s in ckpt._pool.slabs] == slabs  # the pool was reused
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        target["x"] = torch.zeros(2048, 1024, device="cuda", dtype=torch.float64)  # a cast: the row path
        ckpt.load(target)
    for k, v in expected.items():
        got = target[k]
        if isinstance(v, torch.Tensor):
            assert got.device == v.device and torch.equal(got.to(v.dtype), v), k
        else:
            assert got == v


def test_manual_release_leaves_the_stream_alone(tmp_path):
    state = gpu_state()
    expected = state["x"].clone()
    with tc.Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, state, manual_release=True)
        handle.wait_staged()
        assert handle.staged()
        state["x"].zero_()
        handle.wait()
        target = {"x": torch.empty_like(expected)}
        ckpt.load(target)
    assert torch.equal(target["x"], expected)


def test_order_current_stream_lets_work_overlap_the_copies_and_orders_the_change(tmp_path):
    """manual_release, work queued on the trainer's stream (it may run while the copies do), then
    order_current_stream() and a change: the change must not reach the checkpoint."""
    state = gpu_state()
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    a = torch.randn(2048, 2048, device="cuda")
    with tc.Checkpointer(tmp_path, slab_bytes=1 << 20, block_bytes=1 << 16) as ckpt:
        ckpt.reserve(state).result()
        slabs = [s.data_ptr() for s in ckpt._pool.slabs]
        handle = ckpt.save(1, state, manual_release=True)
        for _ in range(20):  # a "forward and backward" that does not touch the state
            a = torch.tanh(a @ a)
        handle.order_current_stream()
        for v in state.values():  # the "optimizer step", queued right away without a host wait
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.mul_(-3.0)
        handle.wait()
        assert [s.data_ptr() for s in ckpt._pool.slabs] == slabs  # staged into the reserved pinned slabs
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        ckpt.load(target)
    for k, v in expected.items():
        assert torch.equal(target[k], v), k


def test_a_save_during_an_unfinished_pinned_reservation(tmp_path, monkeypatch):
    """reserve() still pinning (held back) when save() is called: the save waits for the pinned slabs,
    copies into them, and a change queued right after order_current_stream() does not reach the step."""
    import threading

    import torch_checkpointing.staging as staging

    release, real_take = threading.Event(), staging.HostPool.take

    def held_back_take(pool, *args, **kwargs):
        if kwargs.get("touch"):
            assert release.wait(30)
        return real_take(pool, *args, **kwargs)

    monkeypatch.setattr(staging.HostPool, "take", held_back_take)
    state = gpu_state()
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    with tc.Checkpointer(tmp_path, slab_bytes=1 << 20, block_bytes=1 << 16) as ckpt:
        reservation = ckpt.reserve(state)
        threading.Timer(0.3, release.set).start()
        assert not reservation.done()
        handle = ckpt.save(1, state, manual_release=True)
        assert reservation.done() and all(s.is_pinned() for s in ckpt._pool.slabs)
        handle.order_current_stream()
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.mul_(-3.0)
        handle.wait()
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        ckpt.load(target)
    for k, v in expected.items():
        assert torch.equal(target[k], v), k


def test_a_load_through_a_few_reused_pinned_buffers_gives_the_saved_bits(tmp_path):
    state = {k: v for k, v in gpu_state().items() if isinstance(v, torch.Tensor)}
    target = {k: torch.full_like(v, 7) for k, v in state.items()}  # filled on the current stream, then loaded
    with tc.Checkpointer(tmp_path, block_bytes=1 << 14, read_chunk_bytes=1 << 16, read_threads=3) as ckpt:
        ckpt.save(1, state, blocking=True)
        ckpt.load(target)  # "x" alone is 128 chunks through the 6 pinned buffers of 3 threads
    for k, v in state.items():
        assert target[k].device == v.device
        assert torch.equal(target[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k
