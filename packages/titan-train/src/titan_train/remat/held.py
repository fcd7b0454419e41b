"""What a block holds for its backward under each remat option, and its high marks: every option on one basis.

Each block runs alone on meta (no memory, no compute), wrapped as the trainer wraps it for the option
(wrap.py: the same checkpoint and policy), over a fresh input; a dispatch mode keeps a weak reference to
every storage an op makes, so what is still alive after the forward is what the block holds for its backward
(autograd's saved tensors, a checkpoint's inputs and its policy's cached outputs alike), and the largest sum
alive at any op is its high mark. Three figures per option:
  saved     alive after the forward (the block's input counted if it is held; its output is the next block's);
  forward   the high mark during the forward: what the block's working set adds on top of the blocks before;
  backward  the high mark during its backward with the gradient arriving from the next block: its saved
            tensors, what a checkpoint recomputes, the gradients in flight; the weights' gradients made by
            then are left out of it but their share of the block's is kept (grad_share): the peak model counts
            the block's gradients at that share at its high mark, all of them once it is done.
Compiled blocks (compile.mode=blocks): saved is what the compiled forward passes to save_for_backward under the
option's policy (saved-tensor hooks on the block compiled on meta with the min-cut partitioner, saved.py), the
high marks the eager ones less the eager saved bytes plus the compiled (the compiled backward is not run).
Blocks alike (same class, repr, parameter shapes, input) are measured once.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .saved import COMPILED_BACKEND, fused_attention_profile
from .wrap import wrap_block


@dataclass(frozen=True)
class Held:
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    grad_share: float = 1.0
    """Of the block's weight gradients, the share made by its backward's high mark (by bytes)."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveStorages(TorchDispatchMode):
    """Weak references to every storage an op makes while active (but `skip`'s), the bytes still alive and
    the high mark of that sum, read after every op."""

    def __init__(self, skip: set[int], balanced_rows: int = 0):
        super().__init__()
        self.skip, self.balanced_rows = skip, balanced_rows
        self.refs: dict[int, tuple[StorageWeakRef, int, int]] = {}  # address -> (ref, bytes, serial)
        self.serial = 0  # addresses are reused: a storage is known by the serial it was tracked under
        self.high = 0
        self.at_high: dict[int, int] = {}  # what was alive at the high mark, serial -> bytes

    def track(self, t: torch.Tensor) -> None:
        key = _key(t)  # a freed storage's address is reused: an expired entry under it is replaced
        if key not in self.skip and (key not in self.refs or self.refs[key][0].expired()):
            self.serial += 1
            self.refs[key] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes(), self.serial)

    def serial_of(self, t: torch.Tensor) -> int | None:
        entry = self.refs.get(_key(t))
        return None if entry is None or entry[0].expired() else entry[2]

    def forget(self, t: torch.Tensor) -> None:
        self.refs.pop(_key(t), None)
        self.skip.add(_key(t))

    def alive(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n, _ in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # MoE counts.tolist() on meta: balanced
            return self.balanced_rows
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        alive = self.alive()
        if alive > self.high:
            self.high, self.at_high = alive, {serial: n for _, n, serial in self.refs.values()}
        return out


@dataclass
class BlockCall:
    """How the model calls a block: its input's shape and dtype, and the rest of its arguments (shared)."""
    shape: torch.Size
    dtype: torch.dtype
    args: tuple
    kwargs: dict

    def shared(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor)]


def _outside(block: nn.Module, call: BlockCall) -> set[int]:
    return {_key(t) for t in (*block.parameters(), *block.buffers(), *call.shared())}


def eager_held(block: nn.Module, call: BlockCall, save_ops: tuple[str, ...] | None, balanced_rows: int = 0) -> Held:
    """The block under `save_ops` (wrap.py), forward and backward once on meta under LiveStorages; the
    collector off meanwhile, so a reference cycle frees its tensors at the same point every run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _eager_held(block, call, save_ops, balanced_rows)
    finally:
        if enabled:
            gc.enable()


def _eager_held(block: nn.Module, call: BlockCall, save_ops: tuple[str, ...] | None, balanced_rows: int) -> Held:
    wrapped = wrap_block(block, save_ops)
    # a leaf's AccumulateGrad holds it; its clone is the block's input, alive only if the block holds it
    leaf = torch.empty(call.shape, dtype=call.dtype, device="meta", requires_grad=True)
    live = LiveStorages(_outside(block, call) | {_key(leaf)}, balanced_rows)
    with torch.enable_grad(), fused_attention_profile():
        with live:
            out = wrapped(leaf.clone(), *call.args, **call.kwargs)
        forward = live.high
        live.forget(out)  # the next block's input
        gc.collect()
        saved = live.alive()  # after the collection: a cycle's tensors are not held for the backward
        live.high = 0
        params = [p for p in block.parameters() if p.requires_grad]
        with live:
            grad = torch.ones_like(out)
            grads = torch.autograd.grad(out, [leaf, *params], grad, allow_unused=True)
        own = {live.serial_of(g): g.untyped_storage().nbytes() for g in grads[1:] if g is not None}
        at_peak = sum(n for serial, n in live.at_high.items() if serial in own)
    share = at_peak / max(sum(own.values()), 1)
    return Held(saved, forward, live.high - at_peak, share)


def compiled_saved(block: nn.Module, call: BlockCall, save_ops: tuple[str, ...] | None) -> int:
    """What the block under `save_ops`, compiled on meta (min-cut partitioner), passes to save_for_backward."""
    compiled = torch.compile(wrap_block(block, save_ops), backend=COMPILED_BACKEND)
    outside = _outside(block, call)
    seen: dict[int, torch.Tensor] = {}  # kept alive so no key is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _key(t) not in outside:
            seen.setdefault(_key(t), t)
        return t

    x = torch.empty(call.shape, dtype=call.dtype, device="meta", requires_grad=True).clone()
    with torch.enable_grad(), fused_attention_profile(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x, *call.args, **call.kwargs)
    seen.pop(_key(out), None)
    return sum(t.untyped_storage().nbytes() for t in seen.values())


def held_options(block: nn.Module, call: BlockCall, options: dict[str, tuple[str, ...] | None], *,
                 compiled: bool, balanced_rows: int = 0) -> dict[str, Held]:
    """Held per option name (see the module docstring)."""
    result = {}
    for name, save_ops in options.items():
        held = eager_held(block, call, save_ops, balanced_rows)
        if compiled:
            saved = compiled_saved(block, call, save_ops)
            shift = saved - held.saved_bytes
            held = Held(saved, held.forward_peak_bytes + max(shift, 0), held.backward_peak_bytes + shift,
                        held.grad_share)
        result[name] = held
    return result


def block_signature(block: nn.Module, call: BlockCall) -> tuple:
    """Blocks with equal signatures hold alike: measured once."""
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    shared = tuple((tuple(t.shape), t.dtype) for t in call.shared())
    return type(block).__qualname__, repr(block), params, tuple(call.shape), call.dtype, shared
