"""fuse_pointwise: chains of pointwise aten ops, each made one submodule of the step graph, and compiled by
Inductor into one kernel where its tensors are on CUDA.

A chain is a path a -> b -> ... of pointwise ops (torch.Tag.pointwise, not in-place, not random) where
each value but the last has exactly one user, the next op: its intermediates then live only inside the
fused kernel (no memory traffic, no allocation). The chain runs where its last op ran; a chain never
spans an op that writes memory, so moving its earlier ops there reads the same inputs.

Not bitwise on CUDA: Inductor keeps intermediates in registers at fp32 (bf16 ops round every
intermediate in eager) and may contract a*b+c into an FMA. On CPU the chains stay the captured ops, run
one after another (bitwise), unless `compile_on` names "cpu": the test measures the difference so.
The dump lists each chain's ops (<tag>_ops.txt: "module PointwiseChain" counts and one line per chain).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from .passes import _writes, register_graph_pass


class PointwiseChain(nn.Module):
    """One chain's ops as a GraphModule; `compile` makes them one Inductor kernel (on first call)."""

    def __init__(self, graph_module: fx.GraphModule, *, compile: bool):
        super().__init__()
        self.graph_module = graph_module
        self.ops = [str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"]
        self.run = (torch.compile(graph_module, backend="inductor", fullgraph=True, dynamic=False)
                    if compile else graph_module)

    def forward(self, *inputs):
        return self.run(*inputs)


def _is_pointwise(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    tags = node.target.tags
    return (torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
            and not node.target._schema.is_mutable and isinstance(node.meta.get("val"), torch.Tensor))


def pointwise_chains(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The graph's maximal pointwise chains of 2 ops or more, in graph order."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    writes_before = [0]
    for node in nodes:
        writes_before.append(writes_before[-1] + _writes(node))

    def next_in_chain(node: fx.Node) -> fx.Node | None:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        no_write_between = writes_before[position[user]] == writes_before[position[node] + 1]
        return user if _is_pointwise(user) and no_write_between else None

    chains, taken = [], set()
    for node in nodes:
        if node in taken or not _is_pointwise(node):
            continue
        if any(_is_pointwise(i) and next_in_chain(i) is node for i in node.all_input_nodes):
            continue  # not a chain's start: it continues its input's chain
        chain = [node]
        while (following := next_in_chain(chain[-1])) is not None and following not in taken:
            chain.append(following)
        if len(chain) >= 2:
            chains.append(chain)
            taken.update(chain)
    return chains


def _replace(gm: fx.GraphModule, chain: list[fx.Node], name: str, *, compile: bool) -> None:
    inside = set(chain)
    inputs = list(dict.fromkeys(i for node in chain for i in node.all_input_nodes if i not in inside))
    sub = fx.Graph()
    env = {i: sub.placeholder(f"input_{k}") for k, i in enumerate(inputs)}
    for node in chain:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(env[chain[-1]])
    gm.add_submodule(name, PointwiseChain(fx.GraphModule(gm, sub), compile=compile))
    with gm.graph.inserting_before(chain[-1]):
        fused = gm.graph.call_module(name, tuple(inputs))
    fused.meta["val"] = chain[-1].meta["val"]
    chain[-1].replace_all_uses_with(fused)
    for node in reversed(chain):
        gm.graph.erase_node(node)


def fuse_chains(gm: fx.GraphModule, *, compile_on: tuple[str, ...] = ("cuda",)) -> fx.GraphModule:
    """Each pointwise chain as a PointwiseChain submodule, compiled where its output's device type is in
    `compile_on`."""
    for k, chain in enumerate(pointwise_chains(gm)):
        device = chain[-1].meta["val"].device.type
        _replace(gm, chain, f"pointwise_chain_{k}", compile=device in compile_on)
    return gm


@register_graph_pass("fuse_pointwise", bitwise=False)
def fuse_pointwise(gm: fx.GraphModule) -> fx.GraphModule:
    """Fuse chains of pointwise ops with single-use intermediates: one Inductor kernel each on CUDA (not
    bitwise: fp32 intermediates, FMA contraction); on CPU grouped, run as captured."""
    return fuse_chains(gm)
