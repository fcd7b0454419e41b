"""Mixture of experts: router, stacked experts, optional shared experts, aux-loss-free bias.

Routing (per token): scores = softmax or sigmoid of the router logits (float32); the experts are
chosen by top-k of `scores + expert_bias` (optionally limited to the `topk_group` best of `n_group`
expert groups), and weighted by the un-biased scores of the chosen experts (renormalised when
`norm_topk_prob`, then times `route_scale`). The bias therefore steers only selection, which is
the aux-loss-free balancing of DeepSeek-V3; a trainer updates it from `tokens_per_expert`.
`score_func="sqrtsoftplus"` (DeepSeek-V4) scores sqrt(softplus(logits)); with `hash_vocab_size` the
experts come from the frozen table `tid2eid[token_id]` instead of a top-k (DeepSeek-V4's hash layers).
With `score_func="topk_softmax"` (gpt-oss, Mixtral) the experts are the top-k of
`logits + expert_bias` and their weights the softmax over the chosen experts' logits alone.
Shared experts (one SwiGLU FFN every token passes) are added to the routed output, optionally
scaled per token by a sigmoid gate (Qwen2-MoE / Qwen3-Next / Qwen3.5).

gpt-oss adds a router bias (`router_bias`, part of the logits, unlike `expert_bias`), biases on
every expert projection (`expert_linear_bias`) and a clamped SwiGLU (`activation`).

Muse Spark scales the router logits (`router_logit_scale`) and runs its experts at a pooled width:
with `expert_pool_dim` set, tokens pass `pre_expert_proj` (dim -> pool) and `pre_expert_norm`, each
expert's output passes `post_expert_norm` before its routing weight, and the sum `post_expert_proj`
(pool -> dim). The router still reads the un-pooled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.components.ffn import ClampedSwiGLU, FeedForward, swiglu
from titan_models.components.norms import NormConfig

ExpertImplementation = Literal["auto", "loop", "grouped_mm"]
EXPERT_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "loop", "grouped_mm")
SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid", "topk_softmax", "sqrtsoftplus")


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_dim: int
    num_shared_experts: int = 0  # shared hidden width = num_shared_experts * expert_dim
    shared_expert_dim: int | None = None  # the shared experts' hidden width when set (Qwen2/3-Next/3.5: its own size)
    shared_expert_gate: bool = False  # scale the shared output by sigmoid(x . w_gate) per token (Qwen3-Next/3.5)
    score_func: Literal["softmax", "sigmoid", "topk_softmax", "sqrtsoftplus"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    implementation: ExpertImplementation = "auto"
    router_bias: bool = False  # a bias in the router's logits (gpt-oss)
    expert_linear_bias: bool = False  # biases on each expert's gate, up and down projections (gpt-oss)
    activation: ClampedSwiGLU | None = None  # None: silu(gate) * up
    router_logit_scale: float = 1.0  # router logits are multiplied by this before scoring (Muse Spark)
    expert_pool_dim: int | None = None  # experts' input/output width, pooled by projections (Muse Spark)
    pre_expert_norm: NormConfig | None = None  # on the pooled tokens (needs expert_pool_dim)
    post_expert_norm: NormConfig | None = None  # on each expert's output, before its routing weight
    # hash routing (DeepSeek-V4's first layers): a frozen table `tid2eid` [hash_vocab_size, top_k] names each
    # token id's experts; the scores still weight them. The forward then needs `token_ids`.
    hash_vocab_size: int | None = None

    def build(self, dim: int) -> "MoE":
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.score_func == "topk_softmax" and self.n_group > 1:
            raise ValueError("score_func='topk_softmax' does not combine with group-limited routing (n_group > 1)")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and "
                f"topk_group ({self.topk_group}) must be in [1, n_group]"
            )
        if self.shared_expert_gate and not self.shared_width:
            raise ValueError("shared_expert_gate needs shared experts (num_shared_experts or shared_expert_dim)")
        if self.expert_pool_dim is not None and self.expert_pool_dim < 1:
            raise ValueError(f"expert_pool_dim must be a positive width or None, got {self.expert_pool_dim}")
        if self.pre_expert_norm is not None and self.expert_pool_dim is None:
            raise ValueError("pre_expert_norm normalises the pooled tokens: it needs expert_pool_dim")
        if self.hash_vocab_size is not None and (self.hash_vocab_size < 1 or self.score_func == "topk_softmax"):
            raise ValueError(f"hash_vocab_size must be >= 1 and score_func a per-expert score (softmax, sigmoid, "
                             f"sqrtsoftplus); got {self.hash_vocab_size}, {self.score_func!r}")
        if self.implementation not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {EXPERT_IMPLEMENTATIONS}, got {self.implementation!r}")
        return MoE(dim, self)

    @property
    def shared_width(self) -> int:
        """Hidden width of the shared-expert FFN (0: none)."""
        if self.shared_expert_dim is not None:
            return self.shared_expert_dim
        return self.expert_dim * self.num_shared_experts

    @property
    def active_experts_fraction(self) -> float:
        return self.top_k / self.num_experts


class Router(nn.Module):
    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(dim, config.num_experts, bias=config.router_bias)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor, hashed: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (weights [tokens, top_k] float32, experts [tokens, top_k] int64); `hashed`
        [tokens, top_k] are the experts of hash routing (then only their weights come from the scores)."""
        cfg = self.config
        bias = None if self.gate.bias is None else self.gate.bias.float()
        logits = F.linear(x.float(), self.gate.weight.float(), bias)  # [T, E]
        if cfg.router_logit_scale != 1.0:
            logits = logits * cfg.router_logit_scale
        if cfg.score_func == "topk_softmax":
            experts = (logits + expert_bias.float()).topk(cfg.top_k, dim=-1, sorted=False).indices  # [T, k]
            return logits.gather(1, experts).softmax(dim=-1) * cfg.route_scale, experts
        if cfg.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        else:
            scores = logits.softmax(dim=-1) if cfg.score_func == "softmax" else logits.sigmoid()
        if hashed is not None:
            return self._weights(scores, hashed), hashed
        choice = scores + expert_bias.float()
        if cfg.n_group > 1:
            # Group score = sum of its two best experts; keep the topk_group best groups.
            grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)  # [T, G, E/G]
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
            top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
            choice = choice.masked_fill(~keep.repeat_interleave(cfg.num_experts // cfg.n_group, dim=1), float("-inf"))
        experts = choice.topk(cfg.top_k, dim=-1, sorted=False).indices  # [T, k]
        return self._weights(scores, experts), experts

    def _weights(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(1, experts)
        if self.config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.config.route_scale


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked Linear-style: w1/w3 [E, expert_dim, dim], w2 [E, dim, expert_dim],
    with `expert_linear_bias` also w1_bias/w3_bias [E, expert_dim] and w2_bias [E, dim].

    `forward(x, counts)` takes rows already sorted by expert (x [rows, dim], counts [E] summing to
    rows) and returns [rows, dim]; this is the seam an expert-parallel or kernel library replaces.
    """

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.implementation = config.implementation
        self.w1 = nn.Parameter(torch.empty(config.num_experts, config.expert_dim, dim))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, dim, config.expert_dim))
        self.w3 = nn.Parameter(torch.empty(config.num_experts, config.expert_dim, dim))
        self.activation = config.activation or swiglu
        if config.expert_linear_bias:
            self.w1_bias = nn.Parameter(torch.zeros(config.num_experts, config.expert_dim))
            self.w2_bias = nn.Parameter(torch.zeros(config.num_experts, dim))
            self.w3_bias = nn.Parameter(torch.zeros(config.num_experts, config.expert_dim))
        else:
            self.w1_bias = self.w2_bias = self.w3_bias = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        impl = self.implementation
        if impl == "auto":
            # torch._grouped_mm's fused kernel wants bf16 on CUDA; elsewhere a loop is as good.
            impl = "grouped_mm" if x.is_cuda and x.dtype == torch.bfloat16 else "loop"
        if impl == "grouped_mm":
            return self._grouped_mm(x, counts)
        return self._loop(x, counts)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        start = 0
        for expert, rows in enumerate(counts.tolist()):  # one host sync for all experts
            if rows:
                xe = x[start : start + rows]
                gate, up = xe @ self.w1[expert].T, xe @ self.w3[expert].T
                if self.w1_bias is not None:
                    gate, up = gate + self.w1_bias[expert], up + self.w3_bias[expert]
                down = self.activation(gate, up) @ self.w2[expert].T
                out[start : start + rows] = down if self.w2_bias is None else down + self.w2_bias[expert]
                start += rows
        return out

    def _grouped_mm(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
        # autocast does not cover _grouped_mm: fp32 master weights are cast as it would cast a Linear's
        w1, w3, w2 = (w.to(x.dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        gate = torch._grouped_mm(x, w1, offs=offsets)
        up = torch._grouped_mm(x, w3, offs=offsets)
        if self.w1_bias is not None:  # each row gets its expert's bias (output_size: no host sync)
            gate = gate + self.w1_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
            up = up + self.w3_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        out = torch._grouped_mm(self.activation(gate, up).to(x.dtype), w2, offs=offsets)
        if self.w2_bias is not None:
            out = out + self.w2_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return out.type_as(x)

    def extra_repr(self) -> str:
        e, ffn, dim = self.w1.shape
        return (f"num_experts={e}, dim={dim}, expert_dim={ffn}, bias={self.w1_bias is not None}, "
                f"implementation={self.implementation}")


class MoE(nn.Module):
    """moe(x [b, s, dim]) -> [b, s, dim]; afterwards `tokens_per_expert` [E] holds that forward's counts."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = Router(dim, config)
        pool = config.expert_pool_dim
        self.pre_expert_proj = nn.Linear(dim, pool, bias=False) if pool is not None else None
        self.pre_expert_norm = config.pre_expert_norm.build(pool) if config.pre_expert_norm is not None else None
        self.experts = GroupedExperts(pool or dim, config)
        self.post_expert_norm = (config.post_expert_norm.build(pool or dim)
                                 if config.post_expert_norm is not None else None)
        self.post_expert_proj = nn.Linear(pool, dim, bias=False) if pool is not None else None
        self.shared_experts = (FeedForward(dim, config.shared_width, activation=config.activation)
                               if config.shared_width else None)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if config.shared_expert_gate else None
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        if config.hash_vocab_size is not None:
            self.register_buffer("tid2eid", torch.zeros(config.hash_vocab_size, config.top_k, dtype=torch.int64))
        else:
            self.tid2eid = None

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        if self.tid2eid is not None:  # a fixed table until a checkpoint's: token t -> experts t*k .. t*k+k-1 (mod E)
            vocab, k = self.tid2eid.shape
            table = torch.arange(vocab * k, device=self.tid2eid.device).view(vocab, k) % self.config.num_experts
            self.tid2eid.copy_(table)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, dim = x.shape
        top_k = self.config.top_k
        tokens = x.reshape(-1, dim)  # [T, dim]
        hashed = None
        if self.tid2eid is not None:
            if token_ids is None:
                raise ValueError("a hash-routed MoE layer needs the token ids (token_ids=)")
            hashed = self.tid2eid[token_ids.reshape(-1)]
        weights, experts = self.router(tokens, self.expert_bias, hashed)  # [T, k] each
        flat_experts = experts.flatten()  # [T*k], slot t*k + j = token t's j-th choice
        # scatter_add into a fixed-size buffer: unlike bincount it needs no device -> host sync
        counts = torch.zeros(self.config.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts))
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts)
        order = flat_experts.argsort(stable=True)  # slots sorted by expert
        token_of_row = order // top_k  # [T*k]
        expert_in = tokens
        if self.pre_expert_proj is not None:
            expert_in = self.pre_expert_proj(tokens)  # [T, pool]
            if self.pre_expert_norm is not None:
                expert_in = self.pre_expert_norm(expert_in)
        routed = self.experts(expert_in[token_of_row], counts)  # [T*k, pool or dim]
        if self.post_expert_norm is not None:
            routed = self.post_expert_norm(routed)
        routed = routed * weights.flatten()[order, None].to(routed.dtype)
        out = torch.zeros_like(expert_in).index_add_(0, token_of_row, routed)
        if self.post_expert_proj is not None:
            out = self.post_expert_proj(out)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        return out.view(batch, seq, dim)
