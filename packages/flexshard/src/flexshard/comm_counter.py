"""`CollectiveCounter`: count every collective (and its bytes) issued while it is active.

A TorchDispatchMode sees each c10d op (`dist.all_gather_into_tensor`, `dist.all_reduce`, ...) and
each functional collective (what DTensor redistributions use), whichever library issued it, so
"this step runs no collective" can be checked rather than assumed. A debugging aid: it adds Python
dispatch overhead to every op while active.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier"}


@dataclass(frozen=True)
class CollectiveCall:
    op: str  # e.g. "_allgather_base_", "_reduce_scatter_base_", "all_gather_into_tensor"
    bytes: int  # size of the largest buffer the collective touches (the gathered / reduced tensor)


class CollectiveCounter(TorchDispatchMode):
    """with CollectiveCounter() as c: ... ; c.count, c.bytes, c.by_op(), c.calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.calls)

    def by_op(self) -> dict[str, int]:
        return dict(Counter(c.op for c in self.calls))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace in _NAMESPACES and name not in _NOT_COLLECTIVES:
            sizes = [_nbytes(a) for a in args] + [_nbytes(out)]
            self.calls.append(CollectiveCall(op=name, bytes=max(sizes)))
        return out


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))
