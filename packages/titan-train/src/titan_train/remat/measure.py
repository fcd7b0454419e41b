"""What each block's forward allocates and computes, op by op: the planner's inputs.

The forward runs on a meta copy of the model (no memory, no compute) under a dispatch mode that records,
per block, each op's output bytes and FLOPs (torch.utils.flop_counter's formulas for matmuls and attention,
one FLOP per output element for the rest; an op whose output aliases an input, a view, adds no bytes): the
FLOPs an option recomputes. Its bytes, for every option alike, are what the block holds for its backward when
run under that option's checkpoint and policy, and its high marks (held.py). Pricing options by the listed
ops' outputs instead (issue 20) is a different basis from what autograd saves: kept blocks were counted one
way, checkpointed ones another. MoE routing counts are data on meta: the planner assumes balanced experts
(each gets its share of the rows).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from .held import BlockCall, Held, block_signature, held_options
from .ops import ATTENTION_OPS, MATMUL_OPS, op_name  # noqa: F401 (re-exported)


@dataclass
class OpRecord:
    name: str
    """The aten op's name without namespace or overload (mm, silu, ...)."""
    bytes: int
    flops: int


@dataclass
class BlockProfile:
    path: str
    """layers.<i>"""
    input_bytes: int
    ops: list[OpRecord] = field(default_factory=list)
    saved_bytes: int | None = None
    """What autograd saves when the block is kept (held.py); None (hand-made profiles): every op output."""
    held: dict[tuple[str, ...] | None, Held] = field(default_factory=dict)
    """Per option's save_ops (None: kept, (): recomputed), what the block holds and its high marks (held.py);
    empty (hand-made profiles): the listed ops' outputs, and one constant transient (peak.py)."""

    @property
    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @property
    def keep_bytes(self) -> int:
        return sum(op.bytes for op in self.ops) if self.saved_bytes is None else self.saved_bytes


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


# Ops returning a view of an input without declaring it in their schema: matmul's reshape of its product
# (_unsafe_view: "unsafe" because autograd treats the view as a new tensor).
UNDECLARED_VIEWS = ("_unsafe_view",)


def _is_view(func, args, kwargs, out) -> bool:
    """The output aliases an input: declared (view, transpose, in-place), named above, or found sharing an
    input's storage (meta tensors have storages too)."""
    schema = getattr(func, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return True
    if op_name(func) in UNDECLARED_VIEWS:
        return True
    inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(outputs) and all(t.untyped_storage()._cdata in inputs for t in outputs)


class _Recorder(TorchDispatchMode):
    def __init__(self, balanced_rows: int):
        super().__init__()
        self.current: BlockProfile | None = None
        self.balanced_rows = balanced_rows
        self.in_attention = False


    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:  # MoE counts.tolist() on meta: balanced
            return self.balanced_rows
        out = func(*args, **kwargs)
        if self.current is not None and not self.in_attention and not _is_view(func, args, kwargs, out):
            packet = getattr(func, "_overloadpacket", None)
            if packet in flop_registry:
                shapes = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, (args, kwargs, out))
                flops = flop_registry[packet](*shapes[0], **shapes[1], out_val=shapes[2])
            else:
                flops = sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            self.current.ops.append(OpRecord(op_name(func), _bytes(out), int(flops)))
        return out


class _Attention(TorchFunctionMode):
    """Records scaled_dot_product_attention as the one fused op it is on a GPU or CPU (on meta it would
    decompose into the math path's products and softmax): output + log-sum-exp bytes, its FLOPs."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or self.recorder.current is None:
            return func(*args, **kwargs)
        self.recorder.in_attention = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.recorder.in_attention = False
        q, k, v = args[:3]
        lse_bytes = out.numel() // out.shape[-1] * 4
        # enable_gqa: keys/values carry fewer heads; the FLOPs are those of the heads broadcast to q's
        k_shape, v_shape = ((*t.shape[:-3], q.shape[-3], *t.shape[-2:]) for t in (k, v))
        flops = sdpa_flop_count(q.shape, k_shape, v_shape)
        self.recorder.current.ops.append(OpRecord("attention", _bytes(out) + lse_bytes, int(flops)))
        return out


def profile_blocks(model: nn.Module, *, rows: int, seq_len: int, dtype: torch.dtype, compiled: bool = False,
                   extra_options: tuple[tuple[str, ...], ...] = (),
                   only: tuple[tuple[str, ...] | None, ...] | None = None) -> list[BlockProfile]:
    """Per-block op records and, per option (plan.OPTIONS and `extra_options`, explicit save lists), what the
    block holds (held.py) over a [rows, seq_len] microbatch in `dtype` activations; compiled: the blocks will
    run compiled (compile.mode=blocks), so what they save is a compiled block's (MoE models are counted eager:
    their routing counts are data). only: measure just these options' save_ops (a bench's quick look)."""
    from .plan import OPTIONS

    meta = model if next(model.parameters()).is_meta else copy.deepcopy(model)
    meta = meta.to(device="meta", dtype=dtype) if not next(meta.parameters()).is_meta else meta.to(dtype=dtype)
    moe = getattr(meta.config, "moe", None)
    tokens_per_expert = rows * seq_len * moe.top_k // moe.num_experts if moe is not None else 0
    recorder = _Recorder(tokens_per_expert)
    profiles: list[BlockProfile] = []
    calls: list[BlockCall] = []

    def enter(name):
        def hook(module, args, kwargs):
            profiles.append(BlockProfile(f"layers.{name}", _bytes(args[0])))
            calls.append(BlockCall(args[0].shape, args[0].dtype, args[1:], kwargs))
            recorder.current = profiles[-1]
        return hook

    handles = [block.register_forward_pre_hook(enter(name), with_kwargs=True) for name, block in meta.layers.items()]
    handles += [block.register_forward_hook(lambda *_: setattr(recorder, "current", None))
                for block in meta.layers.values()]
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), _Attention(recorder), recorder:
            meta.hidden_states(tokens)
    finally:
        for handle in handles:
            handle.remove()
    options = {ops: ops for ops in (only if only is not None else (*OPTIONS.values(), *extra_options))}
    measured: dict[tuple, dict] = {}
    for profile, block, call in zip(profiles, meta.layers.values(), calls, strict=True):
        signature = block_signature(block, call)
        if signature not in measured:
            measured[signature] = held_options(block, call, options, compiled=compiled and moe is None,
                                               balanced_rows=tokens_per_expert)
        profile.held = measured[signature]
        profile.saved_bytes = profile.held[None].saved_bytes
    return profiles
