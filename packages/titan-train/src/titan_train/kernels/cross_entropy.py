"""One chunk of the fused output projection + cross-entropy: per-row loss and d loss / d logits.

    loss[r] = (logsumexp(logits[r]) - logits[r, target[r]]) * valid[r]
    grad[r] = (softmax(logits[r]) - one_hot(target[r])) * valid[r]

The Triton kernel (CUDA) reads each row twice, once for an online log-sum-exp and once for the
gradient, which it writes over the logits in their dtype; arithmetic is fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

_BLOCK, _WARPS = 4096, 8  # the H200 sweep of tools/bench/train_throughput/kernels.py


def cross_entropy_chunk_triton(logits: Tensor, target: Tensor, valid: Tensor, *, block: int = _BLOCK,
                               num_warps: int = _WARPS) -> tuple[Tensor, Tensor]:
    """logits [C, V] (overwritten), target [C] int (any value where not valid), valid [C] bool
    -> (summed loss over valid rows, fp32 scalar; grad [C, V] = the logits' storage).
    block, num_warps: the kernel's tile (tools/bench/train_throughput/kernels.py sweeps them)."""
    from titan_train.kernels.cross_entropy_triton import cross_entropy_kernel

    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [C, V] with contiguous rows"
    rows, vocab = logits.shape
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    cross_entropy_kernel[(rows,)](logits, target, valid.to(torch.float32), row_loss, logits.stride(0),
                                  VOCAB=vocab, BLOCK=block, num_warps=num_warps)
    return row_loss.sum(), logits
