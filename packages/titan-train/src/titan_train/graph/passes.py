"""Graph passes: functions GraphModule -> GraphModule applied to the captured training step.

A pass is registered by name (`register_graph_pass`) or named on the command line as
package.module:function. Each says whether it keeps the step bitwise equal to eager (`bitwise`); one
that does not must say by how much it may differ, and its test measures it.
"""
from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

GraphPass = Callable[[fx.GraphModule], fx.GraphModule]


@dataclass(frozen=True)
class RegisteredPass:
    fn: GraphPass
    bitwise: bool
    """The pass leaves every computed value bit for bit as the captured graph computes it."""
    summary: str


_PASSES: dict[str, RegisteredPass] = {}


def register_graph_pass(name: str, *, bitwise: bool) -> Callable[[GraphPass], GraphPass]:
    """Decorator: make `fn` available as compile.graph_passes entry `name`."""
    def wrap(fn: GraphPass) -> GraphPass:
        if name in _PASSES:
            raise ValueError(f"graph pass {name!r} is already registered")
        _PASSES[name] = RegisteredPass(fn, bitwise, (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return wrap


def graph_passes() -> dict[str, RegisteredPass]:
    """Registered pass names -> their entries."""
    return dict(_PASSES)


def resolve_pass(spec: str) -> GraphPass:
    """A registered name, or package.module:function (ValueError naming what is allowed otherwise)."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr, None)
        except ImportError as e:
            raise ValueError(f"compile.graph_passes {spec}: cannot import {module_name!r} ({e})") from None
        if not callable(fn):
            raise ValueError(f"compile.graph_passes {spec}: {module_name} has no function {attr!r}")
        return fn
    if spec not in _PASSES:
        raise ValueError(f"compile.graph_passes: unknown pass {spec!r}; registered: {', '.join(sorted(_PASSES))} "
                         "(or give package.module:function)")
    return _PASSES[spec].fn


def apply_passes(gm: fx.GraphModule, specs: tuple[str, ...]) -> fx.GraphModule:
    for spec in specs:
        gm = resolve_pass(spec)(gm)
        if not isinstance(gm, fx.GraphModule):
            raise TypeError(f"graph pass {spec} returned {type(gm).__name__}, not a torch.fx.GraphModule")
        gm.graph.lint()
    gm.recompile()
    return gm


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


@register_graph_pass("remove_detach", bitwise=True)
def remove_detach(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop detach/alias nodes (tracing records one per saved tensor): the graph runs without autograd,
    where they only allocate views."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ALIASES:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm


def _is_pure(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    return not schema.is_mutable and not any(a.alias_info is not None and a.alias_info.is_write
                                             for a in schema.arguments) and not node.target.is_view


@register_graph_pass("eliminate_dead_code", bitwise=True)
def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove side-effect-free aten ops whose results nothing uses (in-place and out= ops stay, as do views,
    which in-place ops may write through)."""
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and _is_pure(node):
            gm.graph.erase_node(node)
    return gm


def _writes(node: fx.Node) -> bool:
    """The node may write memory another node reads (an in-place/out= op, or an op this pass cannot see into)."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return node.target is not operator.getitem


@register_graph_pass("sink_allocations", bitwise=True)
def sink_allocations(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each side-effect-free op down to just before its first user (never past an op that writes
    memory), so its output is allocated as late as possible: tracing records ops where autograd ran them,
    often long before their value is needed. Lowers peak memory; every value is computed by the same op
    from the same inputs."""
    nodes = list(gm.graph.nodes)
    position = {node: float(i) for i, node in enumerate(nodes)}  # kept current as nodes move
    next_write, barrier = [None] * len(nodes), None
    for i in range(len(nodes) - 1, -1, -1):
        next_write[i] = barrier
        if _writes(nodes[i]):
            barrier = nodes[i]
    for i in range(len(nodes) - 1, -1, -1):  # users first: they have settled when their inputs move
        node, wall = nodes[i], next_write[i]
        if not _is_pure(node) or not node.users:
            continue
        first_user = min(node.users, key=position.__getitem__)
        target = first_user if wall is None or position[first_user] < position[wall] else wall
        if target.op == "output" or target is node.next:
            continue
        target.prepend(node)
        position[node] = (position[node.prev] + position[target]) / 2
        if position[target] - position[node] < 1e-6:  # gaps halve with each move before one node
            position = {n: float(j) for j, n in enumerate(gm.graph.nodes)}
    return gm


from . import fuse_pointwise as _fuse_pointwise  # noqa: E402,F401  (registers fuse_pointwise; it uses _writes)
