"""A batch-invariant MoE layer: each token's output is bitwise the same whatever other tokens share
the forward (a prefill of many tokens, or one decode step).

titan-models' MoE is already token-wise in exact arithmetic; what varies with the batch is rounding:
the router and expert GEMMs change kernels with their row counts (here `ops.matmul`, fixed tiles),
softmax/sigmoid and silu round their vector tails differently (here exp-based forms), and the top-k
contributions of a token are summed by `index_add_` in whatever order (here: in the token's own
choice order, as elementwise adds). Group-limited routing (n_group > 1, DeepSeek-V3) is per token
too: each group's score is its best two experts' scores added elementwise, the kept groups and the
experts are exact top-k selections of one token's row, so no rounding depends on the batch.
"""
from __future__ import annotations

import torch
from titan_models.components.moe import MoEConfig
from torch import nn

from titan_rl.batch_invariant import ops, torch_ops


def unsupported_features(config: MoEConfig) -> list[str]:
    """The features of an MoE layer that this module does not compute (empty: it can replace the layer)."""
    return [what for what, used in (
        (f"score_func={config.score_func!r}", config.score_func == "sqrtsoftplus"),
        ("hash routing (hash_vocab_size)", config.hash_vocab_size is not None),
        ("pooled experts (expert_pool_dim)", config.expert_pool_dim is not None),
        ("router_logit_scale", config.router_logit_scale != 1.0)) if used]


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


class BatchInvariantMoE(nn.Module):
    """Holds the original router, experts, shared experts and buffers (the same tensors)."""

    def __init__(self, old: nn.Module) -> None:
        super().__init__()
        cfg = old.config
        assert not unsupported_features(cfg), "batch_invariant() checks the MoE layers before replacing any"
        self.config = cfg
        self.router, self.experts, self.shared_experts = old.router, old.experts, old.shared_experts
        self.shared_gate = getattr(old, "shared_gate", None)  # Qwen3-Next / Qwen3.5's sigmoid gate
        self.register_buffer("expert_bias", old.expert_bias)
        self.register_buffer("tokens_per_expert", old.tokens_per_expert, persistent=False)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, gate = self.config, self.router.gate
        logits = ops.matmul(x.float(), gate.weight.float())
        if gate.bias is not None:
            logits = logits + gate.bias.float()
        if cfg.score_func == "topk_softmax":
            experts = (logits + self.expert_bias).topk(cfg.top_k, dim=-1).indices   # sorted: a fixed order
            return torch_ops.softmax(logits.gather(1, experts)) * cfg.route_scale, experts
        scores = torch_ops.softmax(logits) if cfg.score_func == "softmax" else _sigmoid(logits)
        choice = scores + self.expert_bias
        if cfg.n_group > 1:
            choice = self._limit_to_groups(choice)
        experts = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (torch_ops.tree_sum(weights, keepdim=True) + 1e-20)
        return weights * cfg.route_scale, experts

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's `topk_group` best groups set to -inf; a
        group's score is the sum of its two best experts' (titan-models' Router, DeepSeek-V3)."""
        cfg = self.config
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)      # [T, G, E/G]
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values              # [T, G, 2 or 1]
        group_scores = best[..., 0] if best.shape[-1] == 1 else best[..., 0] + best[..., 1]
        top_groups = group_scores.topk(cfg.topk_group, dim=-1).indices             # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        gate, up = ops.matmul(x, ex.w1[e]), ops.matmul(x, ex.w3[e])
        if ex.w1_bias is not None:
            gate, up = gate + ex.w1_bias[e], up + ex.w3_bias[e]
        act = self.config.activation
        if act is None:
            hidden = ops.silu(gate) * up
        else:  # the clamped SwiGLU with an exp-based sigmoid
            gate = gate.clamp(max=act.limit)
            up = up.clamp(min=-act.limit, max=act.limit)
            hidden = (up + act.up_shift) * (gate * _sigmoid(gate * act.alpha))
        out = ops.matmul(hidden, ex.w2[e])
        return out if ex.w2_bias is None else out + ex.w2_bias[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, experts = self._route(tokens)                                     # [T, k]
        with torch.no_grad():
            self.tokens_per_expert.copy_(torch.bincount(experts.flatten(), minlength=self.config.num_experts))
        routed = torch.zeros(*experts.shape, dim, dtype=x.dtype, device=x.device)  # [T, k, dim]
        for e in torch.unique(experts).tolist():
            token, slot = (experts == e).nonzero(as_tuple=True)
            routed = routed.index_put((token, slot), self._expert(e, tokens[token]))
        out = routed[:, 0] * weights[:, 0, None].to(x.dtype)
        for j in range(1, experts.shape[1]):  # a token's choices summed in its own order
            out = out + routed[:, j] * weights[:, j, None].to(x.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = shared * _sigmoid(ops.matmul(tokens, self.shared_gate.weight))
            out = out + shared
        return out.view(batch, seq, dim)
