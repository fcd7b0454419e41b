"""`ChunkedShard`: the local tensor of an `Owned` or `BlockShard` parameter's DTensor.

DTensor's own placements cannot say "the whole tensor on rank 3" or "these 2-D tiles", so those
parameters are DTensors with placement `Shard(0)` (which keeps norms and other reductions right:
each element lives on exactly one rank) whose local tensor is a `ChunkedShard`: one flat tensor
holding this rank's rectangles back to back, plus the layout. `ChunkedShard` implements the
checkpoint protocol that torch.distributed.checkpoint asks every DTensor local tensor for
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`), so DCP saves each
rectangle at its true offset and can load it into any other layout (RowShard, fully_shard, ...).

Pointwise math (optimizers, `zeros_like`, `copy_`, `.to(dtype)`) runs on the flat data and keeps
the layout; anything else returns plain tensors. Use `flexshard.full_tensor` rather than
`DTensor.full_tensor()` to assemble such a parameter.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from .layout import ParamLayout


class ChunkedShard(torch.Tensor):
    _data: torch.Tensor  # [local_numel] this rank's rectangles, back to back
    _layout: ParamLayout
    _rank: int

    @staticmethod
    def __new__(cls, data: torch.Tensor, layout: ParamLayout, rank: int) -> "ChunkedShard":
        assert data.dim() == 1 and data.numel() == layout.local_numel(rank), (data.shape, layout, rank)
        out = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device, requires_grad=False
        )
        out._data = data
        out._layout = layout
        out._rank = rank
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # type: ignore[override]
        rects = ", ".join(f"{r.offsets}+{r.sizes}" for r in self._layout.rects[self._rank]) or "empty"
        return f"ChunkedShard(rank={self._rank}, {self._layout.placement}, rects=[{rects}], data={self._data!r})"

    def rect_views(self) -> list[torch.Tensor]:
        """This rank's rectangles as views of the flat data (writes go through)."""
        views, offset = [], 0
        for r in self._layout.rects[self._rank]:
            views.append(self._data[offset : offset + r.numel].view(r.sizes))
            offset += r.numel
        return views

    def __tensor_flatten__(self):
        return ["_data"], (self._layout, self._rank)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ChunkedShard(inner["_data"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_args = pytree.tree_leaves((args, kwargs))
        templates = [a for a in flat_args if isinstance(a, ChunkedShard)]
        unwrap = lambda t: t._data if isinstance(t, ChunkedShard) else t  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        name = func.overloadpacket.__name__
        if name.endswith("_") or func._schema.is_mutable:
            # In-place ops mutate the flat data; hand back the wrappers that were passed in.
            if isinstance(out, torch.Tensor) and isinstance(args[0], ChunkedShard) and out is args[0]._data:
                return args[0]
            if out is None or not isinstance(out, (torch.Tensor, list, tuple)):
                return out
        if name.startswith("_foreach_") and isinstance(out, (list, tuple)) and isinstance(args[0], (list, tuple)):
            # Output i belongs to input i of the first list argument.
            return type(out)(_rewrap(o, a) if isinstance(a, ChunkedShard) else o for o, a in zip(out, args[0]))
        return pytree.tree_map(lambda o: _rewrap(o, templates[0]), out)

    # --- torch.distributed.checkpoint protocol (DTensor forwards these to its local tensor) ---

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(r.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes)),
                    properties=props,
                    size=torch.Size(self._layout.shape),
                ),
            )
            for r in self._layout.rects[self._rank]
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
            for r in self._layout.rects[self._rank]
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for r, view in zip(self._layout.rects[self._rank], self.rect_views()):
            if torch.Size(r.offsets) == index.offset:
                return view
        raise ValueError(f"{index.fqn}: rank {self._rank} holds no piece at offset {tuple(index.offset)}")


def _rewrap(out: Any, template: ChunkedShard) -> Any:
    """Results shaped like the flat data keep the template's layout; anything else stays plain."""
    if isinstance(out, torch.Tensor) and not isinstance(out, ChunkedShard) and out.shape == template._data.shape:
        if out.dim() == 1:
            return ChunkedShard(out, template._layout, template._rank)
    return out
