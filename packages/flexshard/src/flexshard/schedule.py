"""When buckets gather, free and reduce: forward/backward hooks and the per-root schedule.

Per bucket, on its trigger module (the deepest module containing all its parameters):
  pre-forward   gather (waiting on a prefetch if one is in flight), start the next bucket's gather,
                swap the full parameters in, and mark the inputs so backward tells us when the
                module's backward has finished;
  post-forward  swap the sharded parameters back, free the full ones (reshard_after_forward) and
                hook the outputs' gradients;
  pre-backward  (first output gradient) gather again, prefetching the previous bucket;
  post-backward (all marked inputs got gradients) pack gradients, start the reduce-scatter, free.
At the end of backward (an autograd engine callback) the root reduces buckets whose inputs carried
no gradient (e.g. embeddings), waits for every reduce-scatter and writes the sharded gradients.
Collective order must agree across ranks: the prefetch order is recorded in the first forward
and then fixed, so every rank issues the same sequence.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .bucket import Bucket, BucketState
from .mixed_precision import MixedPrecision, cast_floating


class Schedule:
    """Shared by every sharded module under one root (created at the root's first forward)."""

    def __init__(self, states: list["ShardState"]) -> None:
        self.states = states
        self.buckets = [b for s in states for b in s.buckets]
        self.forward_order: list[Bucket] = []
        self.recording = True
        self.in_backward = False
        self.pending: list[Bucket] = []

    def position(self, bucket: Bucket) -> int | None:
        try:
            return self.forward_order.index(bucket)
        except ValueError:
            return None

    def neighbour(self, bucket: Bucket, step: int) -> Bucket | None:
        if self.recording:
            return None
        pos = self.position(bucket)
        if pos is None or not 0 <= pos + step < len(self.forward_order):
            return None
        return self.forward_order[pos + step]

    def begin_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        # Buckets still waiting for gradients (their inputs carried none), in a rank-independent order.
        order = list(reversed(self.forward_order)) + [b for b in self.buckets if b not in self.forward_order]
        for bucket in order:
            if bucket.forwarded and not bucket.reduced and bucket.requires_grad:
                self.reduce(bucket)
        for bucket in self.pending:
            bucket.finish_reduce()
        self.pending.clear()
        self.end_iteration()

    def reduce(self, bucket: Bucket) -> None:
        # Gradients live on the unsharded Parameter objects whether or not their storage is gathered.
        bucket.launch_reduce()
        bucket.reduced = True
        bucket.reshard()
        self.pending.append(bucket)

    def end_iteration(self) -> None:
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.swap_out()  # in case a forward was cut short (see ParamSlot.swap_in)
            if bucket.state is not BucketState.SHARDED:
                bucket.reshard()
            bucket.reset_iteration()
        self.in_backward = False


class ShardState:
    """What one `flexshard.shard(module, ...)` call manages."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], mp: MixedPrecision, mesh) -> None:
        self.module = module
        self.buckets = buckets
        self.mp = mp
        self.mesh = mesh
        self.schedule: Schedule | None = None
        self.is_root = False

    def lazy_init(self) -> None:
        if self.schedule is not None:
            return
        states = [m._flexshard_state for m in self.module.modules() if getattr(m, "_flexshard_state", None) is not None]
        states = [s for s in states if s.schedule is None]
        schedule = Schedule(states)
        for s in states:
            s.schedule = schedule
        self.is_root = True
        # The root's parameters are needed again as soon as backward starts: keep them (like fully_shard).
        for bucket in self.buckets:
            bucket.reshard_after_forward = False

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.lazy_init()
        schedule = self.schedule
        if self.is_root and not schedule.in_backward and any(b.forwarded for b in schedule.buckets):
            # A grad-enabled forward never followed by backward left buckets gathered: start clean.
            schedule.end_iteration()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = cast_floating(self.mp.param_dtype, (args, kwargs))
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        schedule = self.schedule
        if self.is_root and not schedule.in_backward:
            schedule.recording = False
            if not torch.is_grad_enabled():
                schedule.end_iteration()
        if self.mp.output_dtype is not None:
            output = cast_floating(self.mp.output_dtype, output)
        return output


def register_hooks(state: ShardState) -> None:
    # Prepended hooks run before the user's; registering buckets in reverse keeps bucket order,
    # and the state's own pre-hook (root detection, input casting) goes in front of them all.
    for bucket in reversed(state.buckets):
        bucket.trigger.register_forward_pre_hook(_bucket_pre_forward(state, bucket), prepend=True, with_kwargs=True)
        bucket.trigger.register_forward_hook(_bucket_post_forward(state, bucket), prepend=True)
    state.module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    state.module.register_forward_hook(state.post_forward)


def _bucket_pre_forward(state: ShardState, bucket: Bucket):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        state.lazy_init()
        schedule = state.schedule
        if schedule.in_backward:  # activation-checkpoint recompute: parameters only
            bucket.unshard()
            _swap_in(bucket)
            return args, kwargs
        if schedule.recording and bucket not in schedule.forward_order:
            schedule.forward_order.append(bucket)
        bucket.launch_gather()
        nxt = schedule.neighbour(bucket, +1)
        if nxt is not None and not nxt.forwarded:
            nxt.launch_gather()
        bucket.wait_gather()
        _swap_in(bucket)
        bucket.forwarded = True
        if torch.is_grad_enabled() and bucket.requires_grad:
            args, kwargs, marked = _mark_inputs(bucket, schedule, args, kwargs)
            if marked:
                bucket.expected_signals += 1
            else:
                bucket.unsignalled_forward = True
        return args, kwargs

    return hook


def _bucket_post_forward(state: ShardState, bucket: Bucket):
    def hook(module: nn.Module, args: tuple, output: Any):
        for slot in bucket.slots:
            slot.swap_out()
        schedule = state.schedule
        if schedule.in_backward:
            return output
        if bucket.reshard_after_forward:
            bucket.reshard()
        if torch.is_grad_enabled():
            output = _hook_output_grads(bucket, schedule, output)
        return output

    return hook


def _swap_in(bucket: Bucket) -> None:
    for slot in bucket.slots:
        slot.swap_in()


def _mark_inputs(bucket: Bucket, schedule: Schedule, args: tuple, kwargs: dict):
    flat, spec = pytree.tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return args, kwargs, False
    outs = _PostBackward.apply(bucket, schedule, *[flat[i] for i in idx])
    for i, t in zip(idx, outs):
        flat[i] = t
    args, kwargs = pytree.tree_unflatten(flat, spec)
    return args, kwargs, True


def _hook_output_grads(bucket: Bucket, schedule: Schedule, output: Any) -> Any:
    def pre_backward(grad: torch.Tensor) -> None:
        schedule.begin_backward()
        if bucket.backward_started or bucket.reduced:
            return
        bucket.backward_started = True
        bucket.launch_gather()
        prev = schedule.neighbour(bucket, -1)
        if prev is not None and not prev.reduced and prev.forwarded:
            prev.launch_gather()
        bucket.wait_gather()

    for t in pytree.tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(pre_backward)
    return output


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is done."""

    @staticmethod
    def forward(ctx, bucket: Bucket, schedule: Schedule, *inputs: torch.Tensor):
        ctx.bucket, ctx.schedule = bucket, schedule
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        bucket, schedule = ctx.bucket, ctx.schedule
        bucket.signals += 1
        if bucket.signals == bucket.expected_signals and not bucket.unsignalled_forward and not bucket.reduced:
            schedule.begin_backward()
            schedule.reduce(bucket)
        return (None, None) + grads
