"""The save paths bench_checkpoint.py times in its training loop, behind one small interface.

Each path: `prepare(state)` once after the first step (where a trainer would set things up),
`before_update()` right before every optimizer step, `save(step, state)` at the end of a step,
`wait()` until the last save is durable, `load(target, step)`, `close()`. A save first waits for the
previous one to be durable (as trainers do; with saves far enough apart it has long finished).
"""
from __future__ import annotations

import contextlib
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import torch_checkpointing as tc

PATHS = ("tc", "tc_unreserved", "tc_direct", "tc_default", "dcp", "dcp_pinned", "dcp_stager", "dcp_process")
DESCRIPTIONS = {
    "tc": "torch-checkpointing as titan-train calls it: reserve() after the first step (its pinning runs in "
          "the background), save(manual_release=True), order_current_stream() right before the update",
    "tc_unreserved": "as tc without reserve(): the first save lays out, exchanges and allocates the pinned "
                     "staging memory itself (what reserve() moves out of the loop)",
    "tc_direct": "as tc_unreserved with LocalStorage(direct_io=True): the page-aligned bytes written with "
                 "O_DIRECT, past the page cache, and read so on load where the memory allows (a GPU load's pinned buffers)",
    "tc_default": "torch-checkpointing save() with its defaults (the current stream waits for the copies "
                  "at save time; the pinned pool is allocated by the first save)",
    "dcp": "DCP async_save(checkpoint_id=...), its default stager",
    "dcp_pinned": "DCP with a pinned host copy (allocated once) filled on a side stream, the host waits for "
                  "it, then async_save of that copy (a stager that does not copy again)",
    "dcp_stager": "DCP async_save with DefaultStager(StagingOptions(pinned, shared=False, async staging, "
                  "non-blocking)); staging_completion waited right before the update",
    "dcp_process": "as dcp_stager (shared memory too), async_checkpointer_type=PROCESS",
}


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class TorchCheckpointing:
    def __init__(self, root: Path, *, as_trainer: bool, reserve: bool, io_threads: int | None,
                 direct_io: bool = False, read_threads: int | None = None, read_chunk_bytes: int | None = None,
                 direct_reads: bool | None = None):
        fields = {"keep_last": 2}
        for name, value in (("io_threads", io_threads), ("read_threads", read_threads),
                            ("read_chunk_bytes", read_chunk_bytes)):
            if value:
                fields[name] = value
        self.ckpt = tc.Checkpointer(tc.LocalStorage(root, direct_io=direct_io, direct_reads=direct_reads), **fields)
        self.as_trainer, self.reserve = as_trainer, reserve
        self.reserve_s: float | None = None  # how long reserve()'s background allocation took
        self.handle: tc.SaveHandle | None = None
        self.copying: tc.SaveHandle | None = None

    def prepare(self, state: dict) -> None:
        if self.reserve:
            began = time.perf_counter()
            self.ckpt.reserve(state).add_done_callback(
                lambda _: setattr(self, "reserve_s", time.perf_counter() - began))

    def before_update(self) -> None:
        if self.copying is not None:
            self.copying.order_current_stream()
            self.copying = None

    def save(self, step: int, state: dict) -> None:
        self.handle = self.ckpt.save(step, state, manual_release=self.as_trainer)
        if self.as_trainer:
            self.copying = self.handle

    def wait(self) -> None:
        self.ckpt.wait()

    def load(self, target: dict, step: int) -> None:
        self.ckpt.load(target, step=step)

    def close(self) -> None:
        self.before_update()
        self.ckpt.close()


class _NoCopyStager:
    """An AsyncStager (duck-typed) for a state already copied to host memory: stages nothing."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class DCPPath:
    """DCP async_save in one of its modes; each step in its own folder, the one before the last
    removed in the background once the newer one is durable (room on the disk)."""

    def __init__(self, root: Path, mode: str, device: torch.device):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.root, self.mode, self.device = root, mode, device
        self.cuda = device.type == "cuda"
        # async_save runs collectives on a background thread: on its own group, as trainers do, or
        # they interleave with the training loop's collectives on the default group and deadlock
        self.kwargs: dict = {"process_group": dist.new_group(backend="gloo")}
        if mode in ("dcp_stager", "dcp_process"):
            self.kwargs["async_stager"] = DefaultStager(StagingOptions(
                use_pinned_memory=self.cuda, use_shared_memory=mode == "dcp_process",
                use_async_staging=True, use_non_blocking_copy=self.cuda))
        if mode == "dcp_process":
            self.kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        if mode == "dcp_pinned":
            self.kwargs["async_stager"] = _NoCopyStager()
        self.host: dict | None = None  # dcp_pinned: the host copy
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging: Future | None = None
        self.upload: Future | None = None
        self.saved: list[Path] = []
        self.cleaner = ThreadPoolExecutor(1)

    def prepare(self, state: dict) -> None:
        if self.mode == "dcp_pinned":
            self.host = {"model": {k: _host_like(v, self.cuda) for k, v in state["model"].items()}, "step": 0}

    def before_update(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def save(self, step: int, state: dict) -> None:
        self.wait()
        path = self.root / f"step-{step}"
        to_save = state
        if self.mode == "dcp_pinned":
            to_save = self._fill_host_copy(state)
        response = dcp.async_save(to_save, checkpoint_id=str(path), **self.kwargs)
        if hasattr(response, "upload_completion"):
            self.staging, self.upload = response.staging_completion, response.upload_completion
        else:
            self.upload = response
        self.saved.append(path)

    def _fill_host_copy(self, state: dict) -> dict:
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for k, v in state["model"].items():
                local_of(self.host["model"][k]).copy_(local_of(v), non_blocking=self.cuda)
        if self.cuda:
            self.stream.synchronize()  # the host copy is what async_save writes: it must be complete
        self.host["step"] = state["step"]
        return self.host

    def wait(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None
            if len(self.saved) > 2:
                old = self.saved.pop(0)
                if dist.get_rank() == 0:
                    self.cleaner.submit(shutil.rmtree, old, True)

    def load(self, target: dict, step: int) -> None:
        dcp.load(target, checkpoint_id=str(self.root / f"step-{step}"))

    def close(self) -> None:
        self.before_update()
        self.wait()
        stager = self.kwargs.get("async_stager")
        if stager is not None:
            stager.close()
        self.cleaner.shutdown(wait=True)


def _host_like(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    local = torch.empty(local_of(t).shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    if hasattr(t, "_local_tensor"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(),
                                  run_check=False)
    return local


def make_path(name: str, root: Path, device: torch.device, args):
    """The path `name`; torch-checkpointing's ones with the thread counts and read chunk of `args`."""
    if name in ("tc", "tc_unreserved", "tc_direct", "tc_default"):
        chunk = int(args.read_chunk_mib * 2**20) if args.read_chunk_mib else None
        return TorchCheckpointing(root, as_trainer=name != "tc_default", reserve=name == "tc", io_threads=args.io_threads,
                                  direct_io=name == "tc_direct", read_threads=args.read_threads, read_chunk_bytes=chunk,
                                  direct_reads=True if args.direct_reads else None)
    return DCPPath(root, name, device)
