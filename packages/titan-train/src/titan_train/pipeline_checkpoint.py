"""Checkpoint entries of a pipeline-parallel run, made to fit torch-checkpointing.

torch-checkpointing needs every rank to save the same entries, each tensor described by where its
pieces sit; a pipeline rank holds only its own stages' parameters and optimizer states. `StageEntries`
wraps a rank's ModelState / OptimizerState so that every rank presents the whole model:

- a tensor held by another pp rank appears as a *placeholder*: a DTensor of its global shape and dtype on
  a mesh without this rank, which holds, writes and loads nothing;
- a plain tensor of this rank's stages (no FSDP/TP, or an optimizer's step count) becomes a DTensor
  replicated over this rank's pp slice (the ranks with the same pp coordinate), so exactly one of them
  writes it, instead of a rank that may not hold it at all (plain tensors count as replicated over the
  world); FSDP/TP DTensors already live on meshes inside the slice and pass unchanged;
- the optimizer's param_groups list the parameters of the whole model in model order.

So a pipeline checkpoint reads like a single-process one: same names, full shapes, each tensor written
once. The entries' shapes are exchanged over the pp group at every save (one small all_gather_object).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

Path = tuple[Any, ...]  # keys from the state dict's root to a tensor (model keys contain dots themselves)


def _tensor_leaves(tree: Any, prefix: Path = ()) -> list[tuple[Path, torch.Tensor]]:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    leaves = []
    for key, value in items:
        if isinstance(value, torch.Tensor):
            leaves.append(((*prefix, key), value))
        elif isinstance(value, (dict, list)):
            leaves.extend(_tensor_leaves(value, (*prefix, key)))
    return leaves


def _copy_containers(tree: Any) -> Any:
    """`tree` with new dicts and lists (the tensors and other leaves themselves shared)."""
    if isinstance(tree, dict):
        return {key: _copy_containers(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copy_containers(value) for value in tree]
    return tree


def _set(tree: Any, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {}) if isinstance(tree, dict) else tree[key]
    tree[path[-1]] = value


def _drop(tree: dict, path: Path) -> None:
    """Remove the leaf at `path` and the dicts it leaves empty."""
    parents = [tree]
    for key in path[:-1]:
        parents.append(parents[-1][key])
    del parents[-1][path[-1]]
    for parent, key in zip(reversed(parents[:-1]), reversed(path[:-1])):
        if parent[key]:
            break
        del parent[key]


class StageEntries:
    """A Stateful (ModelState or OptimizerState of this rank's part of the model) whose state_dict presents
    every pp rank's entries; see the module docstring.

    slice_ranks: the global ranks sharing this rank's pp coordinate; model_order: the whole model's parameter
    names in model order (for the optimizer's param_groups)."""

    def __init__(self, inner: Any, *, pp_group: dist.ProcessGroup, slice_ranks: list[int], model_order: list[str]):
        self.inner, self.pp_group = inner, pp_group
        self.slice_ranks, self.model_order = slice_ranks, {name: i for i, name in enumerate(model_order)}
        self._wrapped: dict[Path, torch.Tensor] = {}
        self._placeholders: list[Path] = []
        self._local_params: list[list[str]] | None = None

    def _slice_mesh(self, device_type: str) -> DeviceMesh:
        # Built without process groups: checkpointing only asks a mesh for its shape and this rank's coordinate.
        return DeviceMesh(device_type, torch.tensor(self.slice_ranks), _init_backend=False)

    def state_dict(self) -> dict[str, Any]:
        # Fresh containers: the entries are rewritten below, and the optimizer's state dict shares its
        # per-parameter dicts with the live optimizer (a save, or the first step's reserve, would leave
        # DTensors in its moments and break the next step).
        state = _copy_containers(self.inner.state_dict())
        leaves = _tensor_leaves(state)
        mine = {path: (tuple(t.shape), t.dtype, t.device.type) for path, t in leaves}
        everyone: list[dict] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(everyone, mine, group=self.pp_group)

        self._wrapped = {}
        for path, t in leaves:
            if not isinstance(t, DTensor):
                local = t.detach()
                self._wrapped[path] = t
                _set(state, path, DTensor.from_local(local, self._slice_mesh(local.device.type), [Replicate()],
                                                     run_check=False))
        self._placeholders = []
        me = dist.get_rank()
        for holder, entries in enumerate(everyone):
            holder_rank = dist.get_global_rank(self.pp_group, holder)
            for path, (shape, dtype, device_type) in entries.items():
                if path in mine or path in self._placeholders:
                    continue
                assert holder_rank != me
                mesh = DeviceMesh(device_type, torch.tensor([holder_rank]), _init_backend=False)
                device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else device_type
                # (from_local takes an empty shape for "not given": a 0-dim entry gets a 0-dim local tensor)
                empty = torch.empty(0 if shape else (), dtype=dtype, device=device)
                _set(state, path, DTensor.from_local(
                    empty, mesh, [Replicate()], shape=torch.Size(shape) if shape else None,
                    stride=_contiguous_stride(shape) if shape else None, run_check=False))
                self._placeholders.append(path)

        groups = state.get("param_groups")
        if isinstance(groups, list):
            self._local_params = [list(g["params"]) for g in groups]
            gathered: list[list[list[str]]] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, self._local_params, group=self.pp_group)
            for index, group in enumerate(groups):
                names = {name for per_rank in gathered for name in per_rank[index]}
                group["params"] = sorted(names, key=lambda n: self.model_order.get(n, len(self.model_order)))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The checkpoint filled the wrapped tensors' storage in place: hand the originals back.
        for path, original in self._wrapped.items():
            _set(state, path, original)
        for path in self._placeholders:
            _drop(state, path)
        if self._local_params is not None:
            for group, names in zip(state["param_groups"], self._local_params):
                group["params"] = names
        self.inner.load_state_dict(state)


def _copy_containers(tree: Any) -> Any:
    """The dicts and lists of `tree` copied, its leaves (tensors, numbers) shared."""
    if isinstance(tree, dict):
        return {key: _copy_containers(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copy_containers(value) for value in tree]
    return tree


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))
