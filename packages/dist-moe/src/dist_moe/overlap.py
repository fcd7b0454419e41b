"""Expert all-to-alls in flight while other work runs.

`overlap_all_to_all(hand_over)`: inside the block every all-to-all that `dispatch` and `combine` make
(the split-size exchange, the token rows out and their outputs back, and the reverse exchanges of the
backward) is issued with async_op=True, then `hand_over()` is called, and only after it returns is the
exchange waited on. What each exchange computes is unchanged, so results are bitwise the blocking path's.
The setting is process-wide, not per thread: the autograd engine runs a CUDA backward on its own device
thread, where a per-thread setting made by the thread that called backward would not be seen.

`TakingTurns().run(first, second)`: two pieces of work — say one microbatch's forward and another's
backward, as DualPipeV pairs them (titan-train's parallelism.pp_overlap_ep) — on two threads, never both
at once. Whichever holds the turn runs until it has issued an all-to-all, then hands the turn over, so
that exchange is in flight while the other computes up to its own next exchange (or its end); it waits on
its exchange only when the turn comes back. On gloo the rows move on gloo's threads meanwhile; on NCCL on
its stream while the compute stream takes the other's kernels. The hand-over points are fixed by the
work's structure, so ranks running the same work issue their collectives in the same order, and each
piece's arithmetic is the one it has when run alone.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

_hand_over: Callable[[], None] | None = None


@contextlib.contextmanager
def overlap_all_to_all(hand_over: Callable[[], None]) -> Iterator[None]:
    """Issue each dist-moe all-to-all asynchronously and call hand_over() before waiting on it (see the
    module docstring). One block at a time per process; they do not nest."""
    global _hand_over
    if _hand_over is not None:
        raise ValueError("dist_moe.overlap_all_to_all is already active in this process; blocks do not nest")
    _hand_over = hand_over
    try:
        yield
    finally:
        _hand_over = None


def all_to_all_single(output: Tensor, input: Tensor, *, group: dist.ProcessGroup,
                      output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> None:
    """dist.all_to_all_single into `output`; inside overlap_all_to_all, asynchronous around hand_over()."""
    hand_over = _hand_over
    work = dist.all_to_all_single(output, input, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                  group=group, async_op=hand_over is not None)
    if hand_over is not None:
        hand_over()
        work.wait()


class TakingTurns:
    """Two pieces of work on two threads, one running at a time (see the module docstring); one instance per
    run. `hand_over`, given to overlap_all_to_all, is called by whichever holds the turn right after it has
    issued an all-to-all: the turn passes to the other (unless that has finished) and comes back when the
    other has issued one of its own or finished.

    trace: where each turn's events are appended as (name, event): "start", "issued" (an all-to-all issued,
    turn handed over), "resumed" (turn back, about to wait on that exchange), "end"."""

    def __init__(self, names: tuple[str, str] = ("forward", "backward"), trace: list | None = None):
        self.names, self.trace = names, trace
        self._turn = threading.Condition()
        self._holder = names[0]
        self._finished: set[str] = set()

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        """first() on a new thread, second() on this one; first takes the first turn. Raises what either raised."""
        errors: dict[str, BaseException] = {}
        first_here = _in_callers_context(first)
        helper = threading.Thread(target=self._play, args=(self.names[0], first_here, errors),
                                  name=f"dist-moe {self.names[0]}", daemon=True)
        with overlap_all_to_all(self.hand_over):
            helper.start()
            self._play(self.names[1], second, errors)
            helper.join()
        for name in self.names:
            if name in errors:
                raise errors[name]

    def hand_over(self) -> None:
        with self._turn:
            mine = self._holder
            other = self.names[1] if mine == self.names[0] else self.names[0]
            if other in self._finished:
                return  # running alone: the exchange is waited on at once
            self._record(mine, "issued")
            self._holder = other
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._holder == mine)
            self._record(mine, "resumed")

    def _play(self, name: str, work: Callable[[], None], errors: dict) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._holder == name)
            self._record(name, "start")
        try:
            work()
        except BaseException as error:  # noqa: BLE001 -- re-raised by run() on the calling thread
            errors[name] = error
        finally:
            with self._turn:
                self._record(name, "end")
                self._finished.add(name)
                self._holder = self.names[1] if name == self.names[0] else self.names[0]
                self._turn.notify_all()

    def _record(self, name: str, event: str) -> None:
        if self.trace is not None:
            self.trace.append((name, event))


def _in_callers_context(work: Callable[[], None]) -> Callable[[], None]:
    """work wrapped to run with this thread's grad mode, CUDA device and stream (per-thread settings a new
    thread would otherwise start from scratch)."""
    grad_enabled = torch.is_grad_enabled()
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        with contextlib.ExitStack() as settings:
            settings.enter_context(torch.set_grad_enabled(grad_enabled))
            if stream is not None:
                torch.cuda.set_device(stream.device)
                settings.enter_context(torch.cuda.stream(stream))
            work()

    return run
