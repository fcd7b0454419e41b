"""`flexshard.shard`: turn a module's parameters into sharded DTensor parameters and install the schedule."""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .bucket import Bucket, contiguous_stride
from .chunked import ChunkedShard
from .layout import assign_owners, make_layout
from .mixed_precision import MixedPrecision
from .placements import Owned, PlacementRule, resolve_placement
from .schedule import ShardState, register_hooks
from .slot import ParamSlot

BucketSpec = int | Sequence[str | Sequence[str]] | None


def shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    placements: PlacementRule = None,
    buckets: BucketSpec = None,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `module`'s parameters over a 1-D `mesh`, like `fully_shard`: call it on inner modules
    first and on the root last; parameters already managed by an inner call are skipped.

    placements: one placement for all, `{name_pattern: placement}` (fnmatch, first match wins), or
        `fn(name, param) -> placement | None`; names are relative to `module`. Default RowShard().
    buckets: None (one bucket), an int (bytes per bucket, parameters in registration order), or a
        list whose entries (a pattern or a list of patterns) each make a bucket of the parameters they
        match here (none: no bucket); leftovers form one more.
    mp_policy: `flexshard.MixedPrecision` or torch's `MixedPrecisionPolicy`.
    reshard_after_forward: free gathered parameters after forward and gather again in backward
        (the root call keeps them, as fully_shard does).
    Returns `module`, whose parameters are now DTensors.
    """
    mesh = _check_mesh(mesh)
    if getattr(module, "_flexshard_state", None) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded by flexshard.shard")
    mp = MixedPrecision.coerce(mp_policy)
    rank, world = mesh.get_local_rank(), mesh.size()
    device = _mesh_device(mesh)

    params, registrations, names = _unmanaged_params(module)
    groups = _bucket_groups(names, [p.numel() * p.element_size() for p in params], buckets)
    state_buckets: list[Bucket] = []
    for index, group in enumerate(groups):
        slots = _shard_group(
            group, params, registrations, names, placements=placements, mp=mp, mesh=mesh, device=device, rank=rank, world=world
        )
        _check_one_reduce_dtype(index, slots, mp)
        trigger_name = _common_module([n for i in group for n in _module_paths(registrations[i], module)])
        state_buckets.append(
            Bucket(
                index=index,
                slots=slots,
                mesh=mesh,
                device=device,
                reduce_dtype=mp.reduce_dtype,
                reshard_after_forward=reshard_after_forward,
                trigger=module.get_submodule(trigger_name),
                trigger_name=trigger_name,
            )
        )
    _move_buffers(module, device)
    state = ShardState(module, state_buckets, mp, mesh)
    module._flexshard_state = state
    register_hooks(state)
    return module


def _shard_group(
    group: list[int],
    params: list[torch.Tensor],
    registrations: list[list[tuple[nn.Module, str]]],
    names: list[str],
    *,
    placements: PlacementRule,
    mp: MixedPrecision,
    mesh: DeviceMesh,
    device: torch.device,
    rank: int,
    world: int,
) -> list[ParamSlot]:
    """Lay out one bucket's parameters, install their sharded DTensors on every module holding them,
    and return their slots in bucket order."""
    placements_ = [resolve_placement(placements, names[i], params[i]) for i in group]
    fixed = [p.rank if isinstance(p, Owned) else None for p in placements_]
    owned = [j for j, p in enumerate(placements_) if isinstance(p, Owned)]
    owners = dict(zip(owned, assign_owners([params[group[j]].numel() for j in owned], [fixed[j] for j in owned], world, mesh)))
    slots = []
    for j, i in enumerate(group):
        param = params[i]
        layout = make_layout(tuple(param.shape), placements_[j], world, owners.get(j))
        floating = torch.is_floating_point(param)
        gather_dtype = mp.param_dtype if (mp.param_dtype is not None and floating) else param.dtype
        slot = ParamSlot(fqn=names[i], registrations=registrations[i], layout=layout, rank=rank, gather_dtype=gather_dtype)
        sharded = nn.Parameter(_shard_param(param.detach(), slot, mesh, device), requires_grad=param.requires_grad)
        for mod, attr in slot.registrations:
            mod._parameters[attr] = sharded
        slots.append(slot)
    return slots


def _check_one_reduce_dtype(index: int, slots: list[ParamSlot], mp: MixedPrecision) -> None:
    """A bucket reduce-scatters all its gradients in one collective, so they must share one dtype."""
    reduce_dtypes = {mp.reduce_dtype or s.gather_dtype for s in slots}
    if len(reduce_dtypes) > 1:
        raise ValueError(
            f"bucket {index} mixes gradient dtypes {sorted(map(str, reduce_dtypes))}; set mp_policy.reduce_dtype "
            "or put parameters of different dtypes in different buckets"
        )


def _check_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError("flexshard.shard needs a DeviceMesh or an initialized default process group")
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"flexshard shards over a 1-D mesh; got {mesh.ndim} dims (pass mesh['dp'] for a named dim)")
    return mesh


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _unmanaged_params(module: nn.Module) -> tuple[list[torch.Tensor], list[list[tuple[nn.Module, str]]], list[str]]:
    """Parameters not already managed by an inner shard() call or held inside a module torch's fully_shard
    wrapped (e.g. expert-parallel MoE layers sharded over their own mesh first; the ignored_params of such a
    unit are its owner's to handle, so they are left alone too), with every (module, attr) holding each."""
    under_fully_shard = {id(sub) for m in module.modules() if isinstance(m, FSDPModule) for sub in m.modules()}
    managed = {
        (id(mod), attr)
        for m in module.modules()
        if getattr(m, "_flexshard_state", None) is not None
        for b in m._flexshard_state.buckets
        for s in b.slots
        for mod, attr in s.registrations
    }
    params: list[torch.Tensor] = []
    registrations: list[list[tuple[nn.Module, str]]] = []
    names: list[str] = []
    index: dict[int, int] = {}
    for mod_name, mod in module.named_modules():
        for attr, p in mod._parameters.items():
            if p is None or (id(mod), attr) in managed:
                continue
            if id(mod) in under_fully_shard:
                continue
            if isinstance(p, DTensor):
                raise TypeError(
                    f"{mod_name + '.' if mod_name else ''}{attr} is already a DTensor; flexshard shards plain "
                    "parameters (combine it with tensor parallelism is not supported yet)"
                )
            if id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
                registrations.append([])
                names.append(f"{mod_name}.{attr}" if mod_name else attr)
            registrations[index[id(p)]].append((mod, attr))
    return params, registrations, names


def _bucket_groups(names: list[str], nbytes: list[int], spec: BucketSpec) -> list[list[int]]:
    if not names:
        return []
    if spec is None:
        return [list(range(len(names)))]
    if isinstance(spec, bool) or not isinstance(spec, (int, Sequence)) or isinstance(spec, str):
        raise TypeError(f"buckets must be None, an int (bytes per bucket) or a list of name patterns, got {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"buckets as a size must be a positive number of bytes, got {spec}")
        groups, size = [[]], 0
        for i, n in enumerate(nbytes):
            if groups[-1] and size + n > spec:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        return groups
    taken: set[int] = set()
    groups = []
    for entry in spec:
        patterns = [entry] if isinstance(entry, str) else list(entry)
        members = [i for i, n in enumerate(names) if i not in taken and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if members:  # one spec serves every shard() call, so a pattern may match nothing here
            taken.update(members)
            groups.append(members)
    rest = [i for i in range(len(names)) if i not in taken]
    return groups + ([rest] if rest else [])


def _module_paths(registrations: list[tuple[nn.Module, str]], root: nn.Module) -> list[str]:
    paths = {id(m): n for n, m in root.named_modules()}
    return [paths[id(mod)] for mod, _ in registrations]


def _common_module(paths: list[str]) -> str:
    """The deepest module path that is a prefix of every path ('' is the root)."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers follow the parameters to the mesh device, as with fully_shard (meta ones wait for to_empty)."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                mod._buffers[name] = buf.to(device)


def _shard_param(full: torch.Tensor, slot: ParamSlot, mesh: DeviceMesh, device: torch.device) -> DTensor:
    layout, rank = slot.layout, slot.rank
    target = full.device if full.is_meta else device
    if slot.is_row:
        rect = layout.rects[rank][0]
        local = full[rect.slices].to(target).clone(memory_format=torch.contiguous_format)  # never alias the input
    else:
        data = layout.local_from_full(full, rank).to(target)
        local = ChunkedShard(data, layout, rank)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(layout.shape), stride=contiguous_stride(layout.shape)
    )
