"""Weights from a trainer to generators on other ranks, by broadcast on a process group of their own.

The sync group holds the trainer's leader rank (the source) and every generator rank. Each message is
a header, int64 [kind, version, consumed], broadcast from the leader, followed for WEIGHTS by the
tensors in buckets:

    WEIGHTS  new weights with their version; `consumed` = rollout batches the trainer has taken so far
    GRANT    no weights: the trainer took another batch at the same version (DAPO's refills, a drop)
    STOP     the run is over

The tensors travel in the generator's compute dtype (the plan is the generator's: at construction the
first generator broadcasts the names, shapes and dtypes of its model's state dict, and the sender
casts to them, asserting the wire dtype of every bucket), so a bf16 generator gets bf16 on the wire
(the round-to-nearest of the trainer's fp32 masters), never the masters themselves. A bucket holds
consecutive tensors of one dtype, at most the first generator's `bucket_bytes` (or one tensor, if larger).

The trainer's own layout does not enter: it hands `send_weights` full tensors, e.g. `full_tensors(model)`,
which all-gathers each FSDP / TP DTensor over the trainer's mesh (a collective of the trainer's ranks,
so every trainer rank iterates it; only the leader sends).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

WEIGHTS, GRANT, STOP = 0, 1, 2
DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_of(model: nn.Module) -> list[TensorSpec]:
    """What a generator's model receives: its state dict's names, shapes and (compute) dtypes, in order."""
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()]


def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each state-dict entry; a sharded DTensor (FSDP, TP) is gathered over its mesh
    (a collective: every rank of the mesh must iterate this alike)."""
    for name, tensor in model.state_dict().items():
        yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _buckets(plan: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices into `plan`, cut into runs of one dtype and at most bucket_bytes (one tensor at least)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, spec in enumerate(plan):
        nbytes = torch.Size(spec.shape).numel() * spec.dtype.itemsize
        if not buckets or spec.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, spec.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _exchange_plan(plan: list[TensorSpec] | None, bucket_bytes: int | None, *, group: dist.ProcessGroup,
                   planner: int) -> tuple[list[TensorSpec], int]:
    """Every member gets the planner's plan and bucket size (both ends must cut the same buckets); a
    generator whose model differs raises."""
    box = [(plan, bucket_bytes) if dist.get_rank() == planner else None]
    dist.broadcast_object_list(box, src=planner, group=group)
    if plan is not None and plan != box[0][0]:
        raise ValueError(f"rank {dist.get_rank()}'s generator model differs from rank {planner}'s: the generators "
                         "must run the same model in the same dtype")
    return box[0]


class WeightSender:
    """The trainer leader's end (rank `source` of `group`; `planner` is the first generator rank, whose
    model and bucket size the sender follows)."""

    def __init__(self, *, group: dist.ProcessGroup, source: int, planner: int,
                 device: torch.device | str = "cpu") -> None:
        """device: where the broadcasts' tensors live (cuda for an NCCL group, cpu for gloo)."""
        assert dist.get_rank() == source, "the sender runs on the trainer's leader rank"
        self.group, self.source, self.device = group, source, torch.device(device)
        self.plan, bucket_bytes = _exchange_plan(None, None, group=group, planner=planner)
        self.buckets = _buckets(self.plan, bucket_bytes)
        self.wire_dtypes = {spec.dtype for spec in self.plan}
        self.sent_bytes = 0

    def _header(self, kind: int, version: int, consumed: int) -> None:
        header = torch.tensor([kind, version, consumed], dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=self.source, group=self.group)

    def send_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, consumed: int) -> None:
        """Broadcast `tensors` (full, in the plan's order) as `version`, cast to the generators' dtypes."""
        self._header(WEIGHTS, version, consumed)
        stream = iter(tensors)
        for bucket in self.buckets:
            parts = []
            for i in bucket:
                spec = self.plan[i]
                name, tensor = next(stream)
                if name != spec.name or tuple(tensor.shape) != spec.shape:
                    raise ValueError(f"the trainer sends {name} {tuple(tensor.shape)} where the generator expects "
                                     f"{spec.name} {spec.shape}: trainer and generator must run the same model")
                parts.append(tensor.detach().to(device=self.device, dtype=spec.dtype).reshape(-1))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            assert flat.dtype == self.plan[bucket[0]].dtype, (flat.dtype, self.plan[bucket[0]].dtype)  # wire dtype
            dist.broadcast(flat, src=self.source, group=self.group)
            self.sent_bytes += flat.numel() * flat.element_size()
        if next(stream, None) is not None:
            raise ValueError("the trainer sends more tensors than the generator's model holds")

    def grant(self, *, version: int, consumed: int) -> None:
        self._header(GRANT, version, consumed)

    def stop(self, *, version: int, consumed: int) -> None:
        self._header(STOP, version, consumed)


@dataclass(kw_only=True)
class WeightMessage:
    kind: int
    version: int
    consumed: int
    weights: dict[str, torch.Tensor] | None = None  # WEIGHTS only: full tensors in the generator's dtypes


class WeightReceiver:
    """A generator's end: `receive()` returns the next message (weights in the model's own dtypes).

    model: the generator's model (its state dict gives the plan; the first generator rank, `planner`,
    publishes it, with its bucket_bytes: the size of each receive buffer). The tensors land on the model's
    device."""

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup, source: int, planner: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.group, self.source = group, source
        self.plan, bucket_bytes = _exchange_plan(plan_of(model), bucket_bytes, group=group, planner=planner)
        self.buckets = _buckets(self.plan, bucket_bytes)
        self.device = next(iter(model.state_dict().values())).device
        self.received_bytes = 0

    def receive(self) -> WeightMessage:
        header = torch.empty(3, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=self.source, group=self.group)
        kind, version, consumed = (int(x) for x in header)
        if kind != WEIGHTS:
            return WeightMessage(kind=kind, version=version, consumed=consumed)
        weights = {}
        for bucket in self.buckets:
            specs = [self.plan[i] for i in bucket]
            sizes = [torch.Size(s.shape).numel() for s in specs]
            flat = torch.empty(sum(sizes), dtype=specs[0].dtype, device=self.device)
            dist.broadcast(flat, src=self.source, group=self.group)
            assert flat.dtype == specs[0].dtype  # what the generator computes in, as planned
            self.received_bytes += flat.numel() * flat.element_size()
            for spec, part in zip(specs, flat.split(sizes)):
                weights[spec.name] = part.view(spec.shape)
        return WeightMessage(kind=kind, version=version, consumed=consumed, weights=weights)
