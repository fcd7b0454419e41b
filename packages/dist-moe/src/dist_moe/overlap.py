"""Expert all-to-alls in flight while other work runs: `overlap_all_to_all(hand_over)`.

Inside the block every all-to-all that `dispatch` and `combine` make (the split-size exchange, the
token rows out and their outputs back, and the reverse exchanges of the backward) is issued with
async_op=True, then `hand_over()` is called, and only after it returns is the exchange waited on.
`hand_over` is where a caller runs other work while the exchange is in flight: titan-train's DualPipeV
overlap runs another microbatch's forward or backward there, on another thread (gloo then moves the
rows on its own threads; NCCL on its stream while the compute stream takes the other's kernels).
What each exchange computes is unchanged, so results are bitwise those of the blocking path.

The setting is process-wide, not per thread: the autograd engine runs a CUDA backward on its own
device thread, where a per-thread setting made by the thread that called backward would not be seen.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

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
