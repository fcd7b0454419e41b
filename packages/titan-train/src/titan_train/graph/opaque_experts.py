"""The routed experts' loop as one opaque op of the step graph.

titan-models' GroupedExperts loop slices its rows by the step's expert counts (`counts.tolist()`), a
shape that changes every step: no static graph can hold it. Graph mode therefore replaces the experts'
forward by a custom op whose forward runs that same loop and whose backward recomputes each expert's
forward and applies autograd's formulas op for op (so the values are bit for bit eager autograd's); the
graph holds one node for each. The cost is a second pass of the experts' forward in backward.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


def _run_loop(x, counts, w1, w2, w3):
    from titan_models.components.ffn import swiglu
    from titan_models.components.moe import GroupedExperts

    experts = SimpleNamespace(w1=w1, w2=w2, w3=w3, w1_bias=None, w2_bias=None, w3_bias=None, activation=swiglu)
    return GroupedExperts._loop(experts, x, counts)


@torch.library.custom_op("titan_graph::experts_loop", mutates_args=())
def experts_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor) -> torch.Tensor:
    return _run_loop(x, counts, w1, w2, w3)


@experts_loop.register_fake
def _(x, counts, w1, w2, w3):
    return torch.empty_like(x)


@torch.library.custom_op("titan_graph::experts_loop_backward", mutates_args=())
def experts_loop_backward(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                          w2: torch.Tensor, w3: torch.Tensor) -> list[torch.Tensor]:
    # Autograd does not run inside a custom op, so this is the loop's backward written out with the ops, in
    # the operand order, that autograd's formulas use (mm: grad @ mat2.T and (self.T @ grad)), so each value
    # is bit for bit eager's. Expert slices do not overlap: summing them in any order is exact.
    gx, g1, g2, g3 = (torch.zeros_like(t) for t in (x, w1, w2, w3))
    start = 0
    for expert, rows in enumerate(counts.tolist()):
        if not rows:
            continue
        xe, g = x[start:start + rows], grad[start:start + rows]
        h1, h3 = xe @ w1[expert].T, xe @ w3[expert].T
        a = F.silu(h1)
        h = a * h3
        gh = g.mm(w2[expert])
        g2[expert] = h.t().mm(g).t()
        gh1 = torch.ops.aten.silu_backward(gh * h3, h1)
        gh3 = gh * a
        gx[start:start + rows] = gh3.mm(w3[expert]) + gh1.mm(w1[expert])
        g1[expert] = xe.t().mm(gh1).t()
        g3[expert] = xe.t().mm(gh3).t()
        start += rows
    return [gx, g1, g2, g3]


@experts_loop_backward.register_fake
def _(grad, x, counts, w1, w2, w3):
    return [torch.empty_like(t) for t in (x, w1, w2, w3)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, counts, w1, w2, w3 = ctx.saved_tensors
    gx, g1, g2, g3 = experts_loop_backward(grad, x, counts, w1, w2, w3)
    return gx, None, g1, g2, g3


experts_loop.register_autograd(_backward, setup_context=_setup)


def use_opaque_experts(model: nn.Module) -> int:
    """Route every titan-models GroupedExperts that runs the loop through the opaque op; returns how many.
    (grouped_mm experts, bf16 on CUDA, have static shapes and trace as they are.)"""
    from titan_models.components.ffn import swiglu
    from titan_models.components.moe import GroupedExperts

    dist_moe_layers = [type(m).__name__ for m in model.modules() if type(m).__module__.split(".")[0] == "dist_moe"]
    if dist_moe_layers:  # its routing's data-dependent splits are not replayed: it left eager from step 2 on
        raise ValueError("compile.mode=graph runs titan-models' MoE layers only, not dist-moe's "
                         f"({dist_moe_layers[0]}, model.moe_impl=dist_moe); use model.moe_impl titan (or auto, "
                         "parallelism.ep 1) or compile.mode none/blocks/regions")
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        if module.activation is not swiglu or module.w1_bias is not None:
            raise ValueError("compile.mode=graph: the opaque expert op implements the plain SwiGLU experts "
                             f"without biases; {module.extra_repr()} with {module.activation} needs "
                             "compile.mode none/blocks/regions")
        module.forward = _opaque_forward(module)
    return len(experts)


def _opaque_forward(module: nn.Module):
    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        impl = module.implementation
        if impl == "grouped_mm" or (impl == "auto" and x.is_cuda and x.dtype == torch.bfloat16):
            return type(module).forward(module, x, counts)
        return experts_loop(x, counts, module.w1, module.w2, module.w3)
    return forward
