"""Several projections of the same input as one matmul.

q/k/v (and the SwiGLU gate/up pair) read the same activations: one GEMM over the concatenated weights
reads them once, gives the small k/v products a GEMM shape that keeps the GPU busy, and in backward
yields the input gradient from one product instead of a sum of three. The fused path is taken only for
plain `nn.Linear` modules holding plain tensors, so anything that replaces a projection (an override, a
LoRA wrapper, a batch-invariant kernel) or shards it (tensor parallelism's DTensors) is called as itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _fusable(linears: tuple[nn.Module, ...]) -> bool:
    return all(type(m) is nn.Linear and m.bias is None and type(m.weight) in (torch.Tensor, nn.Parameter)
               for m in linears)


def project_fused(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor | None:
    """[linears[0](x) | linears[1](x) | ...] as one matmul's output [..., sum(out)], or None when the
    modules are not plain fusable Linears (then call them as themselves)."""
    if not _fusable(linears):
        return None
    weight = torch.cat([m.weight for m in linears])  # [sum(out), in]
    return F.linear(x, weight)


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """(linears[0](x), linears[1](x), ...) computed by one matmul when the modules allow it."""
    fused = project_fused(x, *linears)
    if fused is None:
        return tuple(m(x) for m in linears)
    return fused.split([m.out_features for m in linears], dim=-1)
