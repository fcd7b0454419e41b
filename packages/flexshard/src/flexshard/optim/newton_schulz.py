"""Quintic Newton–Schulz iteration: pushes every singular value of a matrix towards 1.

X0 = G / ||G||_F, then X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) =
(3.4445, -4.7750, 2.0315): coefficients chosen for fast growth of small singular values, so 5
steps land them in roughly [0.7, 1.2] rather than converging exactly (which is all Muon needs).
"""
from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, *, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """g [..., m, n] -> approximately the orthogonal factor U V^T of each matrix, in `dtype`.

    Works on the wide orientation (m <= n) so X X^T is the smaller Gram matrix; leading dims are a batch.
    """
    if g.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix (or a batch of them), got shape {tuple(g.shape)}")
    a, b, c = COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT  # [..., m, m]
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5) -> int:
    """Matmul FLOPs of `newton_schulz` on a [..., m, n] input (2 per multiply-add)."""
    *batch, m, n = shape
    m, n = min(m, n), max(m, n)
    per_step = 2 * m * m * n + 2 * m * m * m + 2 * m * m * n  # X X^T, A A, (bA + cA^2) X
    count = 1
    for d in batch:
        count *= d
    return count * steps * per_step
