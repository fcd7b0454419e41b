"""DTensors whose local tensor says where its pieces sit, through torch.distributed.checkpoint's hooks.

Placements cannot describe every layout: flexshard's Owned and BlockShard parameters, for example,
are `Shard(0)` DTensors whose local tensor holds arbitrary rectangles of the parameter back to back.
Such a local tensor implements the three methods DCP's planner asks a DTensor's local tensor for:
`__create_write_items__(fqn, dtensor)` (what this rank saves: global offset and size of each piece),
`__create_chunk_list__()` (what it holds, for loading) and `__get_tensor_shard__(index)` (the
tensor of the piece at a global offset, sharing the local tensor's storage). They are used as DCP
uses them: write items on save, the chunk list on load, each piece's tensor looked up by its offset.
The local tensor itself is never copied, so a subclass's own bookkeeping does not have to survive
`empty_like`/`copy_`/`pin_memory`; only plain views of its pieces are staged or filled.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

HOOKS = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)


def has_checkpoint_hooks(path: str, local: torch.Tensor) -> bool:
    """Whether `local` (a DTensor's local tensor) describes its own pieces; all three hooks or none."""
    present = [name for name in HOOKS if hasattr(local, name)]
    if present and len(present) != len(HOOKS):
        missing = [name for name in HOOKS if name not in present]
        raise TypeError(
            f"DTensor {path!r}: its local tensor ({type(local).__name__}) implements {present} but not {missing}; "
            "a local tensor that describes its own pieces needs all of " + ", ".join(HOOKS)
        )
    return bool(present)


def hook_chunks(path: str, tensor: DTensor, *, saving: bool) -> list[Chunk]:
    """The pieces of `tensor` this rank saves (saving=True: its write items) or holds (its chunk list)."""
    local, ndim = tensor._local_tensor, tensor.dim()
    chunks: list[Chunk] = []
    if saving:
        for item in local.__create_write_items__(path, tensor):
            data = item.tensor_data
            if data is None:
                raise TypeError(
                    f"DTensor {path!r}: its local tensor asks to save {item.type} (not tensor data); "
                    "only tensor pieces can be stored"
                )
            if tuple(data.size) != tuple(tensor.shape):
                raise ValueError(
                    f"DTensor {path!r}: its local tensor's write item gives global size {tuple(data.size)}, "
                    f"but the DTensor's shape is {tuple(tensor.shape)}"
                )
            chunks.append((tuple(data.chunk.offsets), tuple(data.chunk.sizes)))
    else:
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in local.__create_chunk_list__()]
    for offset, shape in chunks:
        if len(offset) != ndim or len(shape) != ndim:
            raise ValueError(
                f"DTensor {path!r}: its local tensor describes a piece at {offset} of shape {shape}, "
                f"which is not {ndim}-dimensional like the DTensor"
            )
    return chunks


def hook_view(path: str, local: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The piece at global `offset`, a tensor sharing `local`'s storage (filled in place on load)."""
    view = local.__get_tensor_shard__(MetadataIndex(path, torch.Size(offset)))
    # the layout records the DTensor's dtype, and loading picks CUDA streams by the local tensor's device
    if tuple(view.shape) != shape or view.dtype != local.dtype or view.device != local.device:
        raise ValueError(
            f"DTensor {path!r}: its local tensor returned a {view.dtype}{list(view.shape)} piece on {view.device} "
            f"for offset {offset}, but describes it as {local.dtype}{list(shape)} on {local.device}"
        )
    return view
