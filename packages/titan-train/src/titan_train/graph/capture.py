"""GraphTrainer's step: forward, loss and backward of one microbatch captured as one FX graph.

The step function (parameters, buffers, batch, loss scale) -> (summed loss, parameter gradients) is traced
once per batch shape with make_fx on the real tensors (one step's compute, whose results are dropped):
autograd runs during tracing, so the graph holds the forward's and the backward's aten ops, the ones eager
autograd runs, in its order. Real rather than fake tensors, because the model takes decisions on tensor
types (titan-models fuses q/k/v projections only for plain tensors) that must come out as in eager. Graph passes then
rewrite it, and each step runs the graph instead of eager autograd (with grad mode off: the backward is
in the graph). The same kernels on the same inputs give the same bits as eager.

Under FSDP (fully_shard) the collectives stay eager around the graph: its hooks cannot be traced, so the
graph sees unsharded parameters (all-gathered before the first microbatch, DTensor.full_tensor) and
returns unsharded gradients, which are all-reduced and averaged over the shard group (what FSDP's
reduce-scatter computes; with 2 ranks the same bits, since a / 2 + b / 2 = (a + b) / 2 exactly) and
each rank keeps its dim-0 shard as the DTensor gradient. The optimizer update stays eager unless
compile.graph_optimizer captures it (optimizer_graph.py).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from ..multi_token import mtp_objective
from .opaque_experts import use_opaque_experts
from .passes import apply_passes


class GraphStep:
    """graph_step(tokens, labels, document_ids, positions, scale) -> the microbatch's summed loss (detached);
    adds the gradients of `scale * loss` to the parameters' .grad as backward() would.
    With multi-token prediction (mtp_tokens, mtp_labels and mtp_weight given, multi_token.py): the loss
    module's (main, MTP) sums [2], the gradients those of `scale * mtp_objective(sums, mtp_weight)`, the
    objective eager autograd differentiates; mtp_weight enters as a tensor, so one graph serves every step."""

    def __init__(self, loss_module: nn.Module, *, passes: tuple[str, ...], dump_folder: Path | None,
                 autocast: Callable[[], contextlib.AbstractContextManager]):
        self.loss_module, self.passes, self.dump_folder, self.autocast = loss_module, passes, dump_folder, autocast
        self.params = dict(loss_module.named_parameters())
        self.buffers = dict(loss_module.named_buffers())
        for name, p in self.params.items():
            if isinstance(p, DTensor) and (p.device_mesh.ndim != 1 or p.placements != (Shard(0),)):
                raise ValueError(f"compile.mode=graph runs under 1-D FSDP only; {name} is {p.placements} on a "
                                 f"{p.device_mesh.ndim}-D mesh (use dp_shard only, no tp/ep/hsdp)")
        self.sharded = any(isinstance(p, DTensor) for p in self.params.values())
        self.opaque_experts = use_opaque_experts(loss_module)
        self.graphs: dict[tuple, fx.GraphModule] = {}
        self._full: dict[str, torch.Tensor] | None = None  # unsharded parameters of the current step
        self._grads: dict[str, torch.Tensor] = {}  # unsharded gradients summed over this step's microbatches

    def _step_fn(self):
        names = list(self.params)

        def step(params: dict, buffers: dict, tokens, labels, document_ids, positions, scale, mtp_tokens,
                 mtp_labels, mtp_weight):
            mtp = {} if mtp_labels is None else {"mtp_tokens": mtp_tokens, "mtp_labels": mtp_labels}
            with self.autocast():
                loss = functional_call(self.loss_module, {**params, **buffers},
                                       (tokens, labels, document_ids, positions), mtp)
            objective = loss if mtp_labels is None else mtp_objective(loss, mtp_weight)
            grads = torch.autograd.grad(objective * scale, [params[n] for n in names], allow_unused=True)
            return loss.detach(), list(grads)
        return step

    def graph_for(self, args: tuple) -> fx.GraphModule:
        key = tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)
        if key not in self.graphs:
            params = {n: p.detach().requires_grad_(self.params[n].requires_grad)
                      for n, p in self._full_params().items()}
            # The trace computes for real, so its in-place buffer updates happen once more than the step's
            # (the graph replays them): MoE aux-loss-free balancing would count the first microbatch twice.
            before = {n: b.clone() for n, b in self.buffers.items()}
            with _fsdp_hooks_off(self.loss_module), torch.enable_grad():
                gm = make_fx(self._step_fn(), tracing_mode="real")(params, self.buffers, *args)
            for name, value in before.items():
                self.buffers[name].copy_(value)
            gm = apply_passes(gm, self.passes)
            if self.dump_folder is not None:
                write_graph(gm, self.dump_folder, tag=f"step{len(self.graphs)}")
            self.graphs[key] = gm
        return self.graphs[key]

    def _full_params(self) -> dict[str, torch.Tensor]:
        if self._full is None:
            self._full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in self.params.items()}
        return self._full

    @torch.no_grad()
    def __call__(self, tokens, labels, document_ids, positions, scale: float, *, mtp_tokens=None, mtp_labels=None,
                 mtp_weight: float = 0.0, last: bool = True) -> torch.Tensor:
        """last: the step's last microbatch; under FSDP the gradients are then reduced to the shards."""
        assert (mtp_tokens is None) == (mtp_labels is None), "MTP needs both its tokens and its labels"
        scale_t = torch.tensor(scale, dtype=torch.float32, device=tokens.device)
        weight_t = None if mtp_labels is None else torch.tensor(mtp_weight, dtype=torch.float32, device=tokens.device)
        args = (tokens, labels, document_ids, positions, scale_t, mtp_tokens, mtp_labels, weight_t)
        gm = self.graph_for(args)
        loss, grads = gm(self._full_params(), self.buffers, *args)
        for name, grad in zip(self.params, grads):
            if grad is None:
                continue
            if name in self._grads:
                self._grads[name] += grad
            else:
                self._grads[name] = grad
        if last:
            self._finish()
        return loss

    def _finish(self) -> None:
        """Hand the step's gradients to the parameters (reduced to the shards under FSDP)."""
        for name, grad in self._grads.items():
            p = self.params[name]
            if isinstance(p, DTensor):
                grad = _shard_of_mean(grad, p)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad += grad
        self._grads, self._full = {}, None


def _shard_of_mean(full: torch.Tensor, param: DTensor) -> DTensor:
    group = param.device_mesh.get_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dist.all_reduce(full, group=group)
    full /= world
    chunks = torch.chunk(full, world, dim=0)  # FSDP2's and DTensor's Shard(0) split
    local = chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local.contiguous(), param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


@contextlib.contextmanager
def _fsdp_hooks_off(root: nn.Module):
    """Without fully_shard's forward hooks (they all-gather and reshard, which tracing cannot record): the
    traced step gets the unsharded parameters as inputs instead."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    removed: list[tuple[dict, int, Callable]] = []
    for module in root.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if isinstance(getattr(hook, "__self__", None), FSDPState):
                    removed.append((hooks, key, hook))
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, key, hook in removed:
            hooks[key] = hook


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """call_function nodes per op (aten overloads by name) and call_module nodes per module type (as
    "module TYPE"), most frequent first."""
    counts = Counter(str(n.target) if n.op == "call_function" else f"module {type(gm.get_submodule(n.target)).__name__}"
                     for n in gm.graph.nodes if n.op in ("call_function", "call_module"))
    return dict(counts.most_common())


def write_graph(gm: fx.GraphModule, folder: Path, *, tag: str) -> None:
    """<folder>/<tag>.py (the graph as readable code) and <tag>_ops.txt (node counts per op)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{tag}.py").write_text(gm.print_readable(print_output=False, include_stride=True))
    counts = op_counts(gm)
    lines = [f"{count:6d}  {op}" for op, count in counts.items()]
    for name, module in gm.named_children():  # fused submodules (fuse_pointwise's chains): their ops
        if hasattr(module, "ops"):
            lines.append(f"{name}: {len(module.ops)} ops: {', '.join(module.ops)}")
    (folder / f"{tag}_ops.txt").write_text(f"{sum(counts.values())} op nodes\n" + "\n".join(lines) + "\n")
