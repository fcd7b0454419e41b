"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is `hc_mult` streams.

Around each attention or MoE block, one projection of the flattened, RMS-normed streams gives
`pre` (how the streams collapse into the block's input), `post` (how the block's output spreads
back) and `comb` (how the streams mix), each an affine map of those logits scaled by its own
learned scalar: pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = Sinkhorn(softmax(.) + eps),
a doubly stochastic matrix after `sinkhorn_iters` alternate column and row normalisations (so the
mixed residual cannot grow). The new streams are post * block(collapsed) + comb^T @ streams.
Everything is computed in float32 and cast back to the streams' dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(matrix: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] positive -> doubly stochastic: a column normalisation, then `iters - 1` row+column rounds."""
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    return matrix


class HyperConnection(nn.Module):
    """streams [b, s, n, dim] -> (post [b, s, n], comb [b, s, n, n], collapsed [b, s, dim])."""

    def __init__(self, dim: int, *, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        width = (2 + streams) * streams  # pre (n), post (n), comb (n * n)
        self.fn = nn.Parameter(torch.empty(width, streams * dim))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def init_parameter(self, name: str, param: torch.Tensor, generator: torch.Generator) -> bool:
        if name == "fn":
            return False  # a matrix like any other: N(0, 0.02)
        param.fill_(0.0 if name == "base" else 1.0)
        return True

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.streams
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        logits = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = logits.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax((comb_w * comb_s + comb_b).unflatten(-1, (n, n)), dim=-1) + self.eps
        comb = sinkhorn(comb, iters=self.sinkhorn_iters, eps=self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def merge_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """post * out spread over the streams, plus the streams mixed by comb (comb^T @ streams)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The final collapse of the streams [b, s, n, dim] -> [b, s, dim] (sigmoid weights, no mixing)."""

    def __init__(self, dim: int, *, streams: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(streams, streams * dim))
        self.base = nn.Parameter(torch.empty(streams))
        self.scale = nn.Parameter(torch.empty(1))

    init_parameter = HyperConnection.init_parameter

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
