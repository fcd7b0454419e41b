"""`ParamSlot`: one managed parameter — where it is registered, its layout, its unsharded copy."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .chunked import ChunkedShard
from .layout import ParamLayout
from .placements import RowShard


@dataclass(eq=False)
class ParamSlot:
    fqn: str  # name relative to the module given to shard()
    registrations: list[tuple[nn.Module, str]]  # every (module, attribute) holding it (tied weights: several)
    layout: ParamLayout
    rank: int
    gather_dtype: torch.dtype  # dtype of the all-gathered (unsharded) parameter
    unsharded: nn.Parameter | None = None  # full tensor; its storage is freed (size 0) while resharded
    _swapped_out: list[nn.Parameter] = field(default_factory=list)

    @property
    def sharded(self) -> nn.Parameter:
        """The sharded DTensor parameter (read from the module, so `to_empty`/`load_state_dict(assign=True)` stay valid)."""
        if self._swapped_out:
            return self._swapped_out[0]
        module, name = self.registrations[0]
        return module._parameters[name]

    @property
    def is_row(self) -> bool:
        return isinstance(self.layout.placement, RowShard)

    def local_flat(self) -> torch.Tensor:
        """This rank's elements of the sharded parameter, flat [local_numel], sharing storage."""
        return local_flat(self.sharded)

    def alloc_unsharded(self, device: torch.device) -> nn.Parameter:
        if self.unsharded is None:
            self.unsharded = nn.Parameter(
                torch.empty(self.layout.shape, dtype=self.gather_dtype, device=device),
                requires_grad=self.sharded.requires_grad,
            )
        else:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
            storage = self.unsharded.untyped_storage()
            nbytes = self.unsharded.numel() * self.unsharded.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
        return self.unsharded

    def free_unsharded(self) -> None:
        if self.unsharded is not None:
            self.unsharded.grad = None
            self.unsharded.untyped_storage().resize_(0)

    def swap_in(self) -> None:
        """Point every registration at the unsharded parameter (for the bucket's forward).
        Idempotent: a forward cut short (checkpoint recomputation stops as soon as it has what
        backward needs) never runs the post-forward hook that swaps back."""
        assert self.unsharded is not None
        if self._swapped_out:
            return
        for module, name in self.registrations:
            self._swapped_out.append(module._parameters[name])
            module._parameters[name] = self.unsharded

    def swap_out(self) -> None:
        for (module, name), param in zip(self.registrations, self._swapped_out):
            module._parameters[name] = param
        self._swapped_out.clear()


def local_flat(t: torch.Tensor) -> torch.Tensor:
    """The local elements of a flexshard DTensor (or a plain tensor), flat, sharing storage."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(local, ChunkedShard):
        return local._data
    return local.view(-1)
