"""fp8_blockwise weights that flexshard all-gathered as e4m3 in the recipe's own 128 x 128 blocks.

With `parallelism.fsdp_impl flexshard` and `parallelism.fp8_all_gather true`, the weights of converted
Linears get `BlockShard(block=(128, 128), quantize="fp8_e4m3", scales="pow2")` (sharding_impl.py): each rank
quantises its own tiles with fp8_blockwise's rule (power-of-two scales, scaling.py) and one collective
carries e4m3 bytes and scales. A 128 x 128 block lies whole on one rank, so the gathered e4m3 matrix and
scales are bit for bit what quantising the whole gathered weight gives: the forward GEMM takes them as they
are. The backward's W^T blocks are quantised from the dequantised weight flexshard also fills in, which holds
those same values exactly (power-of-two scales), so its operand dequantises to the same numbers too.
"""
from __future__ import annotations

import torch

from .recipes import Recipe
from .scaling import QuantizedMatrix

BLOCK = (128, 128)


def gathered_weight(weight: torch.Tensor, recipe: Recipe) -> QuantizedMatrix | None:
    """W's forward quantisation as flexshard gathered it, when it is the recipe's; None otherwise (quantise W)."""
    if recipe.kernel != "blockwise" or torch.compiler.is_compiling():
        return None  # compiled: the lookup reads a Python attribute of the weight; quantising W gives the same bits
    from flexshard import gathered_fp8

    gathered = gathered_fp8(weight)
    if gathered is None or gathered.block != BLOCK or gathered.rule != "pow2":
        return None
    assert (recipe.weight.rows, recipe.weight.cols) == BLOCK, recipe.weight
    assert gathered.q.shape == weight.shape and weight.shape[1] % BLOCK[1] == 0, (gathered.q.shape, weight.shape)
    return QuantizedMatrix(data=gathered.q, scale=gathered.scales, blocking=recipe.weight, cols=weight.shape[1])
