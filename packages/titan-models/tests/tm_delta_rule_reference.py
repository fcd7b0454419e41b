"""The gated delta rule written out in float64, one token at a time: the one reference the delta-rule
tests (Gated DeltaNet's per-head decay, Kimi Delta Attention's per-channel decay, the Triton kernels)
hold every form to. Differentiable, so it also gives the reference gradients."""
from __future__ import annotations

import torch


def float64_delta_rule(q, k, v, g, beta, initial=None):
    """q, k [b, s, h, dk], v [b, s, h, dv], g [b, s, h] (one log decay per head) or [b, s, h, dk] (per key
    channel), beta [b, s, h], initial [b, h, dk, dv] or None. Per token:
    S <- diag(exp(g_t)) S;  S <- S + k_t beta_t (v_t - S^T k_t)^T;  o_t = S^T q_t.
    Returns (out [b, s, h, dv], final state [b, h, dk, dv]) in float64."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    b, s, h, dk = k.shape
    state = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64, device=v.device) if initial is None
             else initial.double())
    decay = g.exp() if g.dim() == 4 else g.exp()[..., None].expand(b, s, h, dk)
    outs = []
    for t in range(s):
        state = decay[:, t, :, :, None] * state
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - predicted))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, dim=1), state
