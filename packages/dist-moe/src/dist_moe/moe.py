"""A mixture-of-experts layer with the parameter names of titan-models' MoE (docs/conventions.md).

    router.gate              Linear [E, dim]
    experts.w1, experts.w3   [E, expert_dim, dim]   (gate, up)
    experts.w2               [E, dim, expert_dim]   (down)
    shared_experts.w1/w2/w3  Linears, hidden width num_shared_experts * expert_dim (optional)
    expert_bias              buffer [E] float32 (aux-loss-free balancing; selection only)
    tid2eid                  buffer [hash_vocab_size, top_k] int64, hash routing only (a frozen table)
    tokens_per_expert        non-persistent buffer [E] float32: this rank's counts of the last forward

`moe(x [b, s, dim], token_ids=None) -> [b, s, dim]` (a hash-routed layer needs `token_ids` [b, s]).
`swiglu_limit` clamps every SwiGLU, routed and shared (DeepSeek-V4); the routed experts then run on the
torch path (backend "auto" picks it; "triton" is refused).

Muse Spark: `router_logit_scale` multiplies the router logits before scoring; with `expert_pool_dim` P the
experts work at width P between `pre_expert_proj` [P, dim] (then `pre_expert_norm`, zero-centred, when
`pre_expert_norm_eps` is set) and `post_expert_proj` [dim, P], and with `post_expert_norm_eps` each expert's
output passes `post_expert_norm` (input-scaled, dist_moe/norms.py) before its routing weight. The router
still reads the un-pooled tokens. With an expert-parallel group the expert weights are DTensors
sharded on dim 0 over that group (`apply_expert_parallel`), so names, global shapes and
checkpoints are unchanged; each rank routes its own tokens and computes its own experts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dist_moe.backend import BACKENDS, Backend, WeightGrad, check_weight_grad
from dist_moe.dispatch import combine, dispatch, ep_size
from dist_moe.expert_mlp import QUANTIZE, Quantize, expert_mlp
from dist_moe.norms import InputScaledRMSNorm, ZeroCenteredRMSNorm
from dist_moe.routing import (
    ScoreFunc, check_routing_args, forced_balance, hash_experts, hash_table, route, sequence_balance_loss,
)

_ROUTING_FIELDS = ("num_experts", "top_k", "expert_dim", "num_shared_experts", "shared_expert_dim",
                   "shared_expert_gate", "score_func", "n_group", "topk_group", "norm_topk_prob", "route_scale",
                   "hash_vocab_size", "router_logit_scale", "expert_pool_dim")


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    dim: int
    num_experts: int
    top_k: int
    expert_dim: int
    num_shared_experts: int = 0  # shared hidden width = num_shared_experts * expert_dim
    shared_expert_dim: int | None = None  # the shared hidden width when set (Qwen3-Next / Qwen3.5)
    shared_expert_gate: bool = False  # scale the shared output by sigmoid(x . w) per token (shared_gate)
    score_func: ScoreFunc = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    hash_vocab_size: int | None = None  # hash routing: experts from the frozen table tid2eid[token id]
    swiglu_limit: float | None = None  # silu(min(g, L)) * clamp(u, -L, L) in every SwiGLU (DeepSeek-V4)
    router_logit_scale: float = 1.0  # router logits times this before scoring (Muse Spark)
    expert_pool_dim: int | None = None  # the experts' width between pre/post_expert_proj (Muse Spark)
    pre_expert_norm_eps: float | None = None  # a zero-centred RMSNorm on the pooled tokens (needs expert_pool_dim)
    post_expert_norm_eps: float | None = None  # an input-scaled RMSNorm on each expert's output
    aux_loss_alpha: float = 0.0  # > 0 adds DeepSeek-V3's sequence-wise balance loss in training
    # "forced_balance": tokens dealt evenly to the experts (routing.forced_balance), for measurement only
    routing: Literal["learned", "forced_balance"] = "learned"
    ep_group: dist.ProcessGroup | None = None
    # the ranks holding the other parts of this rank's sequences (tensor- or context-parallel ranks running the
    # layer on sequence shards): the balance loss's counts are summed over it (routing.sequence_balance_loss)
    sequence_group: dist.ProcessGroup | None = None
    backend: Backend = "auto"
    weight_grad: WeightGrad = "triton"  # Triton path: who computes the expert weight gradients
    # Triton path: copy the routed rows once and keep them for the backward (expert_mlp's option:
    # faster, R x dim more activation memory, as the usual pipeline holds)
    keep_routed_input: bool = False
    # "fp8_rowwise" / "fp8_blockwise": the routed experts' GEMMs in fp8 (grouped_mm_fp8), forward and
    # backward; "none": bf16 fused kernels. The router and shared experts are not touched.
    quantize: Quantize = "none"

    def __post_init__(self) -> None:
        for name in ("dim", "num_experts", "expert_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.shared_expert_gate and not self.shared_width:
            raise ValueError("shared_expert_gate needs shared experts (num_shared_experts or shared_expert_dim)")
        check_routing_args(num_experts=self.num_experts, top_k=self.top_k, score_func=self.score_func,
                           n_group=self.n_group, topk_group=self.topk_group)
        if self.aux_loss_alpha < 0:
            raise ValueError(f"aux_loss_alpha must be >= 0, got {self.aux_loss_alpha}")
        if self.routing not in ("learned", "forced_balance"):
            raise ValueError(f"routing must be 'learned' or 'forced_balance', got {self.routing!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.hash_vocab_size is not None and self.hash_vocab_size < 1:
            raise ValueError(f"hash_vocab_size must be >= 1 or None, got {self.hash_vocab_size}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be a positive bound or None, got {self.swiglu_limit}")
        if self.expert_pool_dim is not None and self.expert_pool_dim < 1:
            raise ValueError(f"expert_pool_dim must be a positive width or None, got {self.expert_pool_dim}")
        if self.pre_expert_norm_eps is not None and self.expert_pool_dim is None:
            raise ValueError("pre_expert_norm_eps normalises the pooled tokens: it needs expert_pool_dim")
        if self.swiglu_limit is not None and self.backend == "triton":
            raise ValueError("swiglu_limit runs the experts on backend='torch' (or 'auto'); the Triton kernels "
                             "do not clamp")
        check_weight_grad(self.weight_grad)
        if not isinstance(self.keep_routed_input, bool):
            raise TypeError(f"keep_routed_input must be a bool, got {type(self.keep_routed_input).__name__}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")

    @property
    def shared_width(self) -> int:
        return self.shared_expert_dim if self.shared_expert_dim is not None else self.expert_dim * self.num_shared_experts

    @classmethod
    def like(cls, other: object, *, dim: int, **changes) -> "MoEConfig":
        """A config with the routing fields of `other` (any object with those attribute names, e.g.
        titan-models' MoEConfig) plus `dim` and `changes`."""
        fields = {name: getattr(other, name) for name in _ROUTING_FIELDS if hasattr(other, name)}
        return cls(**{**fields, "dim": dim, **changes})

    def build(self) -> "MoE":
        return MoE(self)


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked Linear-style (see the module docstring for shapes)."""

    def __init__(self, dim: int, num_experts: int, expert_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, expert_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, expert_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, expert_dim, dim))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), the shared experts; with `limit` L, silu(min(w1 x, L)) * clamp(w3 x, -L, L)."""

    def __init__(self, dim: int, hidden_dim: int, *, limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2(F.silu(gate) * up)


class MoE(nn.Module):
    """See the module docstring. After a training forward with aux_loss_alpha > 0, `aux_loss` holds
    the (detached) balance loss, this rank's share of it with a `sequence_group`; its gradient reaches the
    router through the layer's output."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.ep_group = config.ep_group
        self.router = Router(config.dim, config.num_experts)
        pool = config.expert_pool_dim
        self.pre_expert_proj = nn.Linear(config.dim, pool, bias=False) if pool is not None else None
        self.pre_expert_norm = (ZeroCenteredRMSNorm(pool, eps=config.pre_expert_norm_eps)
                                if config.pre_expert_norm_eps is not None else None)
        self.experts = GroupedExperts(pool or config.dim, config.num_experts, config.expert_dim)
        self.post_expert_norm = (InputScaledRMSNorm(pool or config.dim, eps=config.post_expert_norm_eps)
                                 if config.post_expert_norm_eps is not None else None)
        self.post_expert_proj = nn.Linear(pool, config.dim, bias=False) if pool is not None else None
        self.shared_experts = (SwiGLU(config.dim, config.shared_width, limit=config.swiglu_limit)
                               if config.shared_width else None)
        self.shared_gate = nn.Linear(config.dim, 1, bias=False) if config.shared_expert_gate else None
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)
        if config.hash_vocab_size is not None:
            self.register_buffer("tid2eid", torch.zeros(config.hash_vocab_size, config.top_k, dtype=torch.int64))
        else:
            self.tid2eid = None
        self.aux_loss: Tensor | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated normal(0, std) weights (a model's own init may overwrite them), zero buffers."""
        for param in self.parameters():
            if param.device.type != "meta":
                nn.init.trunc_normal_(param, std=std, a=-3 * std, b=3 * std)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        if self.tid2eid is not None and self.tid2eid.device.type != "meta":  # until a checkpoint's table
            vocab, top_k = self.tid2eid.shape
            self.tid2eid.copy_(hash_table(vocab, top_k, self.config.num_experts, device=self.tid2eid.device))

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        cfg = self.config
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # [T, dim]
        hashed = None
        if self.tid2eid is not None:
            if token_ids is None or token_ids.numel() != batch * seq:
                raise ValueError(f"a hash-routed MoE layer needs the token ids of its {batch}x{seq} tokens "
                                 f"(token_ids=), got {None if token_ids is None else tuple(token_ids.shape)}")
            hashed = hash_experts(self.tid2eid, token_ids)
        logits = F.linear(tokens.float(), self.router.gate.weight.float())  # [T, E] float32
        if cfg.router_logit_scale != 1.0:
            logits = logits * cfg.router_logit_scale
        routing = route(logits, top_k=cfg.top_k, score_func=cfg.score_func, n_group=cfg.n_group,
                        topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob, route_scale=cfg.route_scale,
                        bias=self.expert_bias, hashed=hashed)
        if cfg.routing == "forced_balance":
            routing = forced_balance(routing, norm_topk_prob=cfg.norm_topk_prob, route_scale=cfg.route_scale)
        expert_in = tokens
        if self.pre_expert_proj is not None:
            expert_in = self.pre_expert_proj(tokens)  # [T, pool]
            if self.pre_expert_norm is not None:
                expert_in = self.pre_expert_norm(expert_in)
        out = self._routed_experts(expert_in, routing.expert_ids, routing.weights)
        if self.post_expert_proj is not None:
            out = self.post_expert_proj(out)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        if cfg.aux_loss_alpha > 0 and self.training and torch.is_grad_enabled():
            aux = sequence_balance_loss(routing.scores.view(batch, seq, -1), routing.expert_ids.view(batch, seq, -1),
                                        alpha=cfg.aux_loss_alpha, group=cfg.sequence_group)
            self.aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux)
        return out.view(batch, seq, dim)

    def _routed_experts(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """x [T, width] -> [T, width]: each token's experts, weighted and summed (with the post-expert norm
        between an expert's output and its weight, if any)."""
        cfg = self.config
        sent = dispatch(x, expert_ids, weights, num_experts=cfg.num_experts, group=self.ep_group)
        with torch.no_grad():
            self.tokens_per_expert.copy_(sent.tokens_per_expert)
        w1, w2, w3 = self._local_expert_weights()
        routed = sent.x
        if torch.is_autocast_enabled(x.device.type):  # expert_mlp is a kernel autocast cannot see: cast as it would
            dtype = torch.get_autocast_dtype(x.device.type)
            routed, w1, w2, w3 = (t.to(dtype) for t in (routed, w1, w2, w3))
        # the clamped SwiGLU exists on the torch path only (MoEConfig refuses it with backend="triton")
        mlp = dict(backend="torch" if cfg.swiglu_limit is not None else cfg.backend, weight_grad=cfg.weight_grad,
                   swiglu_limit=cfg.swiglu_limit, quantize=cfg.quantize, keep_routed_input=cfg.keep_routed_input)
        if self.post_expert_norm is None:
            y = expert_mlp(routed, w1, w2, w3, sent.offsets, sent.row_slot, top_k=sent.top_k, weights=sent.weights,
                           **mlp)
            return combine(y, sent)
        if sent.weights is None:  # expert parallel: one output row per received row, weighted by combine
            y = expert_mlp(routed, w1, w2, w3, sent.offsets, sent.row_slot, top_k=1, **mlp)
            return combine(self.post_expert_norm(y), sent)
        # one process: each (token, expert) slot's own output row, normed, then weighted and summed by token
        slots = sent.row_slot.long()  # [T * k] slots in expert order
        rows = routed.index_select(0, slots // sent.top_k)
        y = expert_mlp(rows, w1, w2, w3, sent.offsets, torch.arange(slots.numel(), device=slots.device), **mlp)
        by_slot = torch.zeros_like(y).index_copy(0, slots, self.post_expert_norm(y))
        wide = torch.promote_types(y.dtype, torch.float32)
        summed = (by_slot.view(*weights.shape, -1).to(wide) * weights.unsqueeze(-1).to(wide)).sum(dim=1)
        return summed.to(y.dtype)

    def _local_expert_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        ranks = ep_size(self.ep_group)
        weights = []
        for w in (self.experts.w1, self.experts.w2, self.experts.w3):
            if _is_dtensor(w):
                w = w.to_local()  # differentiable: the gradient lands on the DTensor parameter's shard
            weights.append(w)
        local = weights[0].shape[0]
        if local * ranks != self.config.num_experts:
            raise ValueError(
                f"with an expert-parallel group of {ranks} ranks each rank holds num_experts/{ranks} = "
                f"{self.config.num_experts // ranks} experts, but experts.w1 has {local} here; shard the expert "
                f"weights with dist_moe.apply_expert_parallel"
            )
        return weights[0], weights[1], weights[2]


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def apply_expert_parallel(moe: MoE, group: dist.ProcessGroup, *, device_type: str | None = None) -> MoE:
    """Shard moe's expert weights on dim 0 over `group` (rank r keeps experts r*E/P .. (r+1)*E/P - 1)
    as DTensor parameters with the global shapes, and route through that group. In place; returns moe.

    Works on meta modules (shard before materialising). `device_type` of the mesh defaults to the
    parameters' device type (cuda when they are on meta and CUDA is available, else cpu).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    if moe.config.num_experts % ranks:
        raise ValueError(f"num_experts={moe.config.num_experts} is not divisible by the group size {ranks}")
    if device_type is None:
        device = moe.experts.w1.device
        device_type = device.type if device.type != "meta" else ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = DeviceMesh.from_group(group, device_type)
    per_rank = moe.config.num_experts // ranks
    for name in ("w1", "w2", "w3"):
        param = getattr(moe.experts, name)
        if _is_dtensor(param):
            raise ValueError(f"experts.{name} is already a DTensor; apply_expert_parallel runs once")
        local = param.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                     stride=param.stride())
        setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    moe.ep_group = group
    moe.config = dataclasses.replace(moe.config, ep_group=group)
    return moe


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer output whose backward also sends gradient 1 into the aux loss, so the
    loss joins the training objective without the trainer adding it."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)
