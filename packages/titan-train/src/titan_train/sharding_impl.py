"""Data-parallel sharding: torch's fully_shard (parallelize.apply_fsdp) or flexshard, by parallelism.fsdp_impl.

flexshard takes a placement per parameter (row, owned, block:RxC), buckets inside each block and fp8
all-gathers of block-placed parameters. This file turns the recipe's typed fields into flexshard's
arguments, shards the model with it, and gives a flexshard model its initial weights: Owned and
BlockShard parameters are DTensors whose local tensor lists its own pieces (a `ChunkedShard`), which
set_model_state_dict cannot place, so each rank copies its pieces out of rank 0's full tensors.
"""
from __future__ import annotations

import fnmatch
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .config import ParallelismConfig, PlacementRules, TrainConfig
from .loss import CausalLMLoss

_BLOCK = re.compile(r"block:(\d+)x(\d+)")
# fp8_blockwise's weight blocks (quantize/recipes.py): flexshard tiles of this size line up with them.
FP8_BLOCKWISE_BLOCK = (128, 128)
# Wrapper components that activation checkpointing and compile insert into parameter names.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def check_sharding_choices(config: TrainConfig, *, dp_replicate: int, tp: int, ep: int) -> None:
    """Combinations flexshard and Muon cannot run, refused before the model is built."""
    par, opt = config.parallelism, config.optimizer
    if par.fsdp_impl == "flexshard":
        # ep: the MoE layers are fully_shard units over their expert-data-parallel mesh first; flexshard
        # shards the rest (attention, dense layers, routers, embeddings) over the data-parallel mesh.
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", par.pp), ("cp", par.cp)):
            if value > 1:
                raise ValueError(f"parallelism.fsdp_impl=flexshard shards over one data-parallel dimension; "
                                 f"parallelism.{name}={value} needs fsdp_impl=fully_shard")
        rules = parse_placements(par.flexshard_placements, fp8=par.fp8_all_gather)
        blockwise = config.quantize.linear == "fp8_blockwise"  # its converted weights get 128x128 fp8 blocks
        if par.fp8_all_gather and not blockwise and not any(_is_block(p) for _, p in rules):
            raise ValueError("parallelism.fp8_all_gather quantizes block placements only; give some parameters "
                             "block:RxC in parallelism.flexshard_placements (e.g. 'layers.*.weight=block:128x128'), "
                             "or quantize.linear fp8_blockwise (its Linears' weights are gathered in its fp8 blocks)")
        for entry in par.flexshard_buckets:
            if not all(p.strip() for p in entry.split("|")):
                raise ValueError(f"parallelism.flexshard_buckets: {entry!r} has an empty pattern")
    else:
        for name in ("flexshard_placements", "flexshard_buckets", "fp8_all_gather"):
            if getattr(par, name):
                raise ValueError(f"parallelism.{name} applies to fsdp_impl=flexshard, not {par.fsdp_impl}")
    if opt.name == "muon":
        # flexshard's Muon orthogonalises whole matrices: plain, flexshard, or Shard(0) on one mesh dimension.
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("ep", ep)):
            if value > 1:
                raise ValueError(f"optimizer.name=muon needs whole or row-sharded matrices on one data-parallel "
                                 f"dimension; parallelism.{name}={value} is not supported with it yet")


def parse_placements(rules: PlacementRules, *, fp8: bool) -> list[tuple[str, object]]:
    """[(pattern, flexshard placement)] from the recipe's (pattern, 'row' | 'owned' | 'block:RxC') pairs."""
    import flexshard

    parsed = []
    for pattern, spec in rules:
        if spec == "row":
            placement = flexshard.RowShard()
        elif spec == "owned":
            placement = flexshard.Owned()
        elif (m := _BLOCK.fullmatch(spec)) and int(m[1]) > 0 and int(m[2]) > 0:
            placement = flexshard.BlockShard(block=(int(m[1]), int(m[2])), quantize="fp8_e4m3" if fp8 else None)
        else:
            raise ValueError(f"parallelism.flexshard_placements: {pattern!r} has placement {spec!r}; allowed: row, "
                             "owned, block:RxC (positive tile rows x columns, e.g. block:128x128)")
        parsed.append((pattern, placement))
    return parsed


def _is_block(placement) -> bool:
    import flexshard

    return isinstance(placement, flexshard.BlockShard)


def _model_name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def placement_rule(rules: list[tuple[str, object]], prefix: str, *, strip: str = "",
                   fp8_weights: frozenset[str] = frozenset()):
    """flexshard's `fn(name, param)` over names relative to the sharded module; patterns see the model's own
    parameter names (prefix + name without `strip`, wrappers removed), as in a checkpoint. fp8_weights: model
    names that get fp8_blockwise's gather placement (FP8_BLOCKWISE_BLOCK tiles) whatever the rules say."""
    import flexshard

    def rule(name: str, param: torch.Tensor):
        full = _model_name(prefix + name.removeprefix(strip))
        if full in fp8_weights:
            return flexshard.BlockShard(block=FP8_BLOCKWISE_BLOCK, quantize="fp8_e4m3", scales="pow2")
        for pattern, placement in rules:
            if fnmatch.fnmatchcase(full, pattern):
                if _is_block(placement) and param.dim() != 2:
                    raise ValueError(f"parallelism.flexshard_placements: {pattern!r} gives {full} "
                                     f"({param.dim()}-D) a block placement, which takes 2-D parameters only")
                return placement
        return None  # flexshard's default, RowShard
    return rule


def apply_flexshard(loss_module: CausalLMLoss, dp_mesh: DeviceMesh, config: ParallelismConfig, *,
                    param_dtype: torch.dtype | None, fp8_weights: tuple[str, ...] = ()) -> None:
    """flexshard.shard each block, then the root (embeddings, final norm, output) through the loss wrapper.

    fp8_weights: the weights of fp8_blockwise's Linears under fp8_all_gather; they are placed
    BlockShard(128 x 128, e4m3, power-of-two scales), the recipe's weight blocks, chosen here whatever
    flexshard_placements says, so the gather carries the forward GEMM's operand (quantize/gathered.py).

    The root call needs its bucket gathered when the loss wrapper runs, but flexshard gathers a bucket when
    the deepest module holding all its parameters runs, here the Transformer, whose forward the loss never
    calls (it calls hidden_states and reads output.weight). An empty, frozen anchor parameter on the
    wrapper makes the wrapper that module; it belongs to no model state (checkpoints, optimizer).
    """
    import flexshard

    rules = parse_placements(config.flexshard_placements, fp8=config.fp8_all_gather)
    fp8 = frozenset(fp8_weights)
    policy = flexshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32)
    buckets = [[p.strip() for p in entry.split("|")] for entry in config.flexshard_buckets] or None
    blocks = list(loss_module.model.layers.items())
    for i, (name, block) in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keep them gathered.
        flexshard.shard(block, dp_mesh, placements=placement_rule(rules, f"layers.{name}.", fp8_weights=fp8),
                        buckets=buckets,
                        mp_policy=policy, reshard_after_forward=config.reshard_after_forward and i < len(blocks) - 1)
    # Real (not meta) storage of no size, so the model's materialization need not know about it.
    loss_module.register_parameter("flexshard_anchor", nn.Parameter(torch.empty(0), requires_grad=False))
    # Root names are relative to the loss wrapper ("model.output.weight"); the rules see the model's names.
    flexshard.shard(loss_module, dp_mesh, placements=placement_rule(rules, "", strip="model.", fp8_weights=fp8),
                    mp_policy=policy,
                    reshard_after_forward=config.reshard_after_forward)


def _pieces(local: torch.Tensor, name: str):
    """(view, slices of the full tensor) for each piece a self-describing local tensor holds."""
    for chunk in local.__create_chunk_list__():
        view = local.__get_tensor_shard__(MetadataIndex(name, chunk.offsets))
        yield view, tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


@torch.no_grad()
def load_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Fill the sharded `model` from `full`, the whole state on rank 0 ({} elsewhere).

    fully_shard / tensor-parallel models: set_model_state_dict(broadcast_from_rank0). Models with
    self-describing shards (flexshard): tensor by tensor, rank 0 broadcasts it and every rank copies its
    pieces, so no rank but 0 ever holds more than one whole tensor.
    """
    state = model.state_dict()
    chunked = any(isinstance(t, DTensor) and hasattr(t._local_tensor, "__create_chunk_list__") for t in state.values())
    if not chunked:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return
    for name, target in state.items():
        local = target._local_tensor if isinstance(target, DTensor) else target
        whole = (full[name].to(device=local.device, dtype=target.dtype) if dist.get_rank() == 0
                 else torch.empty(target.shape, dtype=target.dtype, device=local.device))
        dist.broadcast(whole, src=0)
        if not isinstance(target, DTensor):
            target.copy_(whole)
        elif hasattr(local, "__create_chunk_list__"):
            for view, where in _pieces(local, name):
                view.copy_(whole[where])
        else:  # a DTensor sharded by its placements (flexshard's RowShard is Shard(0))
            local.copy_(distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local())
