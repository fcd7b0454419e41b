"""Attention sinks: a learned logit per head that joins every query's softmax denominator.

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))        out_i = sum_j p_ij v_j

The sink takes probability mass without contributing a value, so a head may attend to "nothing"
(gpt-oss; StreamingLLM's sink token without the token). Two exact ways to compute it:

- eager: append the sink as one more score column, softmax, drop that column;
- fold: from an attention without sinks, out and its log-sum-exp lse = log sum_j exp(s_ij),
  out_sink = out * Z / (Z + exp(sink)) = out * sigmoid(lse - sink). flex_attention returns lse,
  and the gradient flows to the sink through the sigmoid.
"""
from __future__ import annotations

import torch
from torch import nn


class AttentionSinks(nn.Module):
    """Holds the sink logits [num_heads]; `sinks()` returns them. A module (not a bare parameter) so
    a tensor-parallel plan can shard it with the heads (style "headwise") and hand back the local part."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads))

    def forward(self) -> torch.Tensor:
        return self.weight

    def extra_repr(self) -> str:
        return f"num_heads={self.weight.shape[0]}"


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [b, h, s, d] and lse [b, h, s] of sink-free attention -> the output with sinks [h]."""
    dtype = torch.promote_types(out.dtype, torch.float32)  # at least float32
    keep = torch.sigmoid(lse.to(dtype) - sinks.to(dtype)[None, :, None])  # Z / (Z + exp(sink))
    return (out.to(dtype) * keep[..., None]).to(out.dtype)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s_kv, hkv, d], mask bool broadcastable to [b, hq, s, s_kv], sinks [hq]
    or None -> [b, s, hq, d_v]. Scores in the inputs' dtype, the softmax in float32 (float64 inputs: float64)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    scores = (q @ k.transpose(-1, -2)).to(softmax_dtype) * scale  # [b, hq, s, s_kv]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(softmax_dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs.to(v.dtype) @ v).transpose(1, 2)
