"""A QuantizedLinear whose weight torch's ColwiseParallel / RowwiseParallel made a DTensor: each rank quantises
its own shards and runs the recipe's three GEMMs on local tensors, and the output is the DTensor the plain
linear would give, so the plan's input and output redistributions (sequence gathers, reduce-scatters) stay
as they are.

    colwise  W Shard(0) [N / tp, K], x Replicate [M, K]       -> y Shard(-1) [M, N / tp]; dx Partial
    rowwise  W Shard(1) [N, K / tp], x Shard(-1) [M, K / tp]  -> y Partial [M, N] (the plan reduce-scatters)

Numerics against one process. Every operand is quantised on the shard a rank holds; a block of the recipe
that lies inside a shard gets the same scale as in the whole matrix, so the fp8 operands are the 1-process
ones sliced, bit for bit, whenever the split falls on block boundaries. That holds
  - for fp8_blockwise and mxfp8 (1x128 / 128x128 / 1x32 blocks) when the sharded dimension's local extent is a
    multiple of the block: the conversion pass (convert.py) converts under TP only Linears whose local shape is
    (wk/wv of a small model whose kv width / tp is not a multiple of 128 stay in high precision, with a
    warning);
  - for fp8_tensorwise and fp8_rowwise, whose scale covers a whole tensor or a whole row of the reduction, only
    because the blocks that span the split (`spanning_operands`) have their amax max-reduced over the tp group:
    tensorwise, each GEMM operand that is sharded (one scalar all-reduce each); rowwise, the operands whose
    reduction dimension is split (colwise: dy and W^T of the input gradient; rowwise: x and W of the forward),
    a vector of one amax per row. Without it those scales would be local to a shard (finer than one process's:
    no less accurate, but not the same run).
What differs from one process is then only the order of fp32 sums: each rank's GEMM over its K or N slice,
and the partial sums added by the plan's reduce-scatter / all-reduce.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .quantized_matmul import ScaleGroups, quantized_linear
from .recipes import Recipe

# Per TP style: the sharded operands of the three GEMMs (recipes.py names) and which of their dimensions is
# split: "rows" (the operand's first dimension) or "cols" (its reduction dimension).
SHARDED_OPERANDS = {
    "colwise": {"weight": "rows", "weight_t": "cols", "grad_output": "cols", "grad_output_t": "rows"},
    "rowwise": {"x": "cols", "weight": "cols", "weight_t": "rows", "x_t": "rows"},
}


def spanning_operands(recipe: Recipe, style: str) -> frozenset[str]:
    """The sharded operands whose scale blocks cover the whole split dimension (block extent 0 there)."""
    return frozenset(op for op, dim in SHARDED_OPERANDS[style].items() if getattr(getattr(recipe, op), dim) == 0)


def tp_style(weight: DTensor) -> str:
    """colwise (Shard(0) on a 1-D mesh) or rowwise (Shard(1))."""
    placements = weight.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim not in (0, 1):
        raise ValueError(f"quantize.linear under tensor parallelism takes colwise (Shard(0)) or rowwise (Shard(1)) "
                         f"weights on the tp mesh; got placements {placements}")
    return "colwise" if placements[0].dim == 0 else "rowwise"


def sharded_quantized_linear(x: torch.Tensor, weight: DTensor, bias: DTensor | None, recipe: Recipe, *,
                             out_dtype: torch.dtype, backend: str) -> DTensor:
    """The quantised x . W^T (+ bias) of a TP-sharded Linear, as the DTensor the plan's output hook expects."""
    style, mesh = tp_style(weight), weight.device_mesh
    x_placement = Replicate() if style == "colwise" else Shard(x.dim() - 1)
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (x_placement,), run_check=False)
    elif x.placements != (x_placement,):
        x = x.redistribute(mesh, (x_placement,))
    # colwise: this rank's dx covers its N slice only, a partial sum of the whole input gradient
    x_local = x.to_local(grad_placements=(Partial(),) if style == "colwise" else (x_placement,))
    groups = ScaleGroups(group=mesh.get_group(), operands=spanning_operands(recipe, style))
    y = quantized_linear(x_local, weight.to_local(), recipe, out_dtype=out_dtype, backend=backend,
                         groups=groups if groups.operands else None)
    if style == "colwise":
        if bias is not None:  # Shard(0), like the output features
            y = y + bias.to_local().to(out_dtype)
        return DTensor.from_local(y, mesh, (Shard(y.dim() - 1),), run_check=False)
    out = DTensor.from_local(y, mesh, (Partial(),), run_check=False)
    return out if bias is None else out + bias.to(out_dtype)
