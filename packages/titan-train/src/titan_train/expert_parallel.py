"""Mixture-of-experts wiring: which MoE layer runs (titan-models' or dist-moe's), expert parallelism
composed with FSDP, and the aux-loss-free expert-bias update.

Mesh. Expert parallelism borrows its ranks from dp_shard (as torchtitan does): the dp_shard dimension
of the run's mesh is split into (dp_shard_mod_ep, ep), ep innermost, so the ep ranks of a group are
neighbours and every rank keeps its coordinates (dp_shard index = dp_shard_mod_ep index * ep + ep index).

    non-expert parameters   FSDP over dp_shard (x dp_replicate): unchanged
    routed expert weights   split by expert over ep (dist_moe.apply_expert_parallel), then FSDP over
                            dp_shard_mod_ep (x dp_replicate), the data-parallel ranks that hold the same experts
    router gate             replicated (plain tensor); its gradient is summed over the data-parallel ranks here

Gradient scale (decided in Parallelizer.loss_scale). The trainer scales each rank's loss by dp / (global
token count), so that averaging over the dp ranks gives the global mean. An expert shard's gradient
already sums the contributions of all ep ranks whose tokens it served (the all-to-all's backward), so
after FSDP's average over the remaining dp / ep ranks it is ep times too large: `finish_gradients`
divides it by ep. (FSDP's own
gradient divide factor would do it inside the reduction, but with a group of one rank and sum-only
reductions, which gloo needs, torch 2.14 divides twice.)

Under tensor parallelism the MoE layers are not TP-split: each tp rank runs them on its own sequence shard,
so their gradients are summed over tp (`finish_gradients`), the expert shards, whole on every tp rank, enter
checkpoints as replicated over tp (`checkpoint_entries`, tp_replica_checkpoint.py), and the sequence-wise
balance loss sums its counts over the ranks that split each sequence, tp and cp (`split_balance_loss`).

FSDP units. dist-moe's layer reads `experts.w1/w2/w3` inside its own forward (it never calls
`experts(...)`), so the unit holding the expert weights is the MoE module itself. The shared experts
and their sigmoid gate, if any, and Muse Spark's pooling projections and expert norms (called as modules)
are their own units over the dense data-parallel mesh; the router gate, read directly in the MoE
forward, is left out of FSDP (`ignored_params`) and kept whole on every rank.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import dist_moe
import titan_models as tm

from .config import TrainConfig
from .parallelize import matching_modules
from .tp_replica_checkpoint import TPReplicaEntries


def resolve_moe_impl(config: TrainConfig) -> str:
    """titan or dist_moe; checks the MoE fields against each other (before the model is built)."""
    m, ep = config.model, config.parallelism.ep
    impl = m.moe_impl if m.moe_impl != "auto" else ("dist_moe" if ep > 1 else "titan")
    if ep > 1 and impl != "dist_moe":
        raise ValueError(f"parallelism.ep={ep} needs model.moe_impl=dist_moe (or auto), got {m.moe_impl!r}")
    if m.moe_routing not in ("learned", "forced_balance"):
        raise ValueError(f"model.moe_routing must be learned or forced_balance, got {m.moe_routing!r}")
    if m.moe_routing == "forced_balance" and impl != "dist_moe":
        raise ValueError("model.moe_routing=forced_balance needs model.moe_impl=dist_moe (titan-models' MoE "
                         "routes by its router only)")
    if m.moe_aux_loss_weight < 0:
        raise ValueError(f"model.moe_aux_loss_weight must be >= 0, got {m.moe_aux_loss_weight}")
    if m.moe_aux_loss_weight > 0 and impl != "dist_moe":
        raise ValueError("model.moe_aux_loss_weight > 0 needs model.moe_impl=dist_moe (titan-models' MoE has no "
                         "sequence balance loss)")
    if m.moe_keep_routed_input and impl != "dist_moe":
        raise ValueError("model.moe_keep_routed_input needs model.moe_impl=dist_moe (titan-models' MoE has no "
                         "fused gather to replace)")
    if config.training.moe_bias_update_rate < 0:
        raise ValueError(f"training.moe_bias_update_rate must be >= 0, got {config.training.moe_bias_update_rate}")
    return impl


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE modules the model's parallel plan names (e.g. layers.*.moe), in model order."""
    names = [n for pattern in model.parallel_plan.moe for n in matching_modules(model, pattern)]
    return [model.get_submodule(n) for n in sorted(set(names), key=names.index)]


def use_dist_moe(model: nn.Module, *, aux_loss_alpha: float, routing: str = "learned",
                 quantize: str = "none", keep_routed_input: bool = False) -> list[str]:
    """Replace every MoE layer of the (meta) model by dist-moe's, with the same parameter names and
    shapes (tm.override checks them), so weights, init and checkpoints carry over. Returns their names."""
    replaced: list[str] = []
    for pattern in model.parallel_plan.moe:
        if not matching_modules(model, pattern):
            continue  # e.g. mtp.layer.moe on a model without multi-token prediction

        def factory(fqn: str, old: nn.Module) -> nn.Module:
            config = dist_moe.MoEConfig.like(old.config, dim=old.router.gate.in_features, aux_loss_alpha=aux_loss_alpha,
                                             routing=routing, quantize=quantize, keep_routed_input=keep_routed_input,
                                             **_dist_moe_options(fqn, old.config))
            with torch.device(old.router.gate.weight.device):
                return config.build()

        replaced += tm.override(model, pattern, factory)
    return replaced


def _dist_moe_options(fqn: str, moe_config: object) -> dict[str, float | None]:
    """dist-moe's fields for the options of titan-models' MoEConfig that it names otherwise: the clamp of a
    clamped plain SwiGLU (DeepSeek-V4) and Muse Spark's zero-centred pre-expert and input-scaled post-expert
    norms (their eps). Raises for the options it does not implement (gpt-oss's router bias, expert biases and
    shifted activation, the top-k-softmax router; other norms), which would be dropped silently."""
    from titan_models.components.norms import InputScaledRMSNormConfig, ZeroCenteredRMSNormConfig

    unsupported = [name for name, plain in (("router_bias", False), ("expert_linear_bias", False))
                   if getattr(moe_config, name, plain) != plain]
    activation = getattr(moe_config, "activation", None)
    if activation is not None and (activation.alpha, activation.up_shift) != (1.0, 0.0):
        unsupported.append(f"activation={activation}")
    if getattr(moe_config, "score_func", "softmax") == "topk_softmax":
        unsupported.append("score_func='topk_softmax'")
    options: dict[str, float | None] = {"swiglu_limit": None if activation is None else activation.limit}
    for name, kind in (("pre_expert_norm", ZeroCenteredRMSNormConfig), ("post_expert_norm", InputScaledRMSNormConfig)):
        norm = getattr(moe_config, name, None)
        if norm is not None and type(norm) is not kind:
            unsupported.append(f"{name}={norm}")
        options[f"{name}_eps"] = None if norm is None else norm.eps
    if unsupported:
        raise ValueError(f"{fqn}: dist-moe's MoE layer does not implement {', '.join(unsupported)} "
                         "(gpt-oss); use model.moe_impl=titan with parallelism.ep=1")
    return options


def split_dp_shard(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The run's mesh with dp_shard split into (dp_shard_mod_ep, ep): same ranks, same coordinates."""
    names = tuple(mesh.mesh_dim_names)
    i = names.index("dp_shard")
    shape = tuple(mesh.mesh.shape)
    assert shape[i] % ep == 0, (shape, ep)  # resolve_degrees checked it
    ranks = mesh.mesh.reshape(*shape[:i], shape[i] // ep, ep, *shape[i + 1:])
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*names[:i], "dp_shard_mod_ep", "ep", *names[i + 1:]))


def split_balance_loss(moes: list[nn.Module], mesh: DeviceMesh | None, *, tp_sequence_shards: bool) -> None:
    """The sequence-wise balance loss of MoE layers that each see part of every sequence: the context-parallel
    ranks' chunks and, when the layers run on tp's sequence shards (under expert parallelism), the tp ranks'.
    Their expert counts are summed over those ranks (dist-moe's sequence_group), each rank's loss being its
    tokens' share; the share is multiplied by cp, since the cp ranks' gradients are averaged (as the data-
    parallel ranks' are: the loss scale counts them) while the tp ranks' are summed (ExpertParallel's sum
    over tp, TP's reduce-scatter). A no-op for layers without the loss."""
    dims = tuple(d for d in ("cp", "tp")
                 if mesh is not None and mesh[d].size() > 1 and (d == "cp" or tp_sequence_shards))
    losses = [moe for moe in moes if isinstance(moe, dist_moe.MoE) and moe.config.aux_loss_alpha > 0]
    if not dims or not losses:
        return
    group = mesh[dims[0]].get_group() if len(dims) == 1 else mesh[dims]._flatten("cp_tp").get_group()
    cp = mesh["cp"].size()
    for moe in losses:
        alpha = moe.config.aux_loss_alpha * cp
        moe.config = dataclasses.replace(moe.config, sequence_group=group, aux_loss_alpha=alpha)


def data_parallel_groups(mesh: DeviceMesh | None) -> list[dist.ProcessGroup]:
    """The process groups whose ranks see different tokens of the same layers (a sum over all of them,
    one dimension after another, is a sum over the data-parallel ranks)."""
    if mesh is None:
        return []
    return [mesh[d].get_group() for d in ("dp_replicate", "dp_shard", "cp")
            if d in mesh.mesh_dim_names and mesh[d].size() > 1]


class ExpertParallel:
    """Experts split over ep, FSDP-sharded over the rest of data parallel; see the module docstring."""

    def __init__(self, moes: list[nn.Module], mesh: DeviceMesh, ep: int, *, grad_divisor: int):
        """grad_divisor: what the expert gradients are divided by after the step's backward (the
        Parallelizer's expert_grad_divisor, decided with the loss scale)."""
        for moe in moes:
            if not isinstance(moe, dist_moe.MoE):
                raise ValueError(f"parallelism.ep={ep} needs dist-moe's MoE layers (model.moe_impl=dist_moe), "
                                 f"found {type(moe).__name__}")
        if not moes and mesh["pp"].size() == 1:  # a pipeline rank may hold dense layers only
            raise ValueError(f"parallelism.ep={ep}, but the model has no MoE layers to split")
        self.moes, self.ep, self.grad_divisor = moes, ep, grad_divisor
        self.mesh = mesh
        self.expert_mesh = split_dp_shard(mesh, ep)
        if hasattr(DeviceMesh, "_flatten"):
            # Lets DTensor reduce an expert gradient's norm over (dp_shard_mod_ep, ep) in one all-reduce.
            self.expert_mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard_ep")
        self.dp_groups = data_parallel_groups(mesh)
        self.tp_group = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
        self.dp = 1
        for group in self.dp_groups:
            self.dp *= dist.get_world_size(group)
        ep_mesh = self.expert_mesh["ep"]
        for moe in moes:
            dist_moe.apply_expert_parallel(moe, ep_mesh.get_group(), device_type=mesh.device_type)
            # Same shards, but as DTensors of our mesh: fully_shard composes a parameter's own mesh with
            # its data-parallel mesh only when both come from one root mesh.
            for name in ("w1", "w2", "w3"):
                param = getattr(moe.experts, name)
                local = DTensor.from_local(param.to_local(), ep_mesh, [Shard(0)], run_check=False,
                                           shape=param.shape, stride=param.stride())
                setattr(moe.experts, name, nn.Parameter(local, requires_grad=param.requires_grad))

    def apply_fsdp(self, dense_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
                   reshard_after_forward: bool) -> None:
        """FSDP units for the MoE layers; call before the blocks' fully_shard (which then skips them)."""
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        expert_dp_mesh = self.expert_dp_mesh()
        # dist-moe's layer returns a view; FSDP warns because an in-place op on it would skip its backward
        # hook, but the Transformer block adds the MoE output out of place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view tensor")
        for moe in self.moes:
            # the shared experts and their gate (Qwen3-Next / Qwen3.5) and the pooling around the experts (Muse
            # Spark) see every rank's tokens: dense units. The post-expert norm is shared by all experts and sees
            # the rows of every rank's tokens that reach this rank's experts: over the dense mesh its gradient
            # averaged over all data-parallel ranks is the whole one, as for the shared experts.
            dense = ("shared_experts", "shared_gate", "pre_expert_proj", "pre_expert_norm", "post_expert_norm",
                     "post_expert_proj")
            for shared in (getattr(moe, name, None) for name in dense):
                if shared is not None:
                    fully_shard(shared, mesh=dense_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            fully_shard(moe, mesh=expert_dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                        ignored_params={moe.router.gate.weight})

    def expert_dp_mesh(self) -> DeviceMesh:
        """The ranks that hold the same experts but see other tokens: dp_shard_mod_ep, with the context-
        parallel ranks (other chunks of the same sequences) flattened in, and dp_replicate outermost."""
        shard = self.expert_mesh["dp_shard_mod_ep"]
        if self.expert_mesh["cp"].size() > 1:
            shard = self.expert_mesh["dp_shard_mod_ep", "cp"]._flatten("dp_shard_mod_ep_cp")
        if self.expert_mesh["dp_replicate"].size() > 1:
            return self.expert_mesh["dp_replicate", shard.mesh_dim_names[0]]
        return shard

    def checkpoint_entries(self, state: dict) -> dict:
        """The run's checkpoint state with the model and optimizer entries presenting the expert shards, which
        every tp rank holds whole, as replicated over tp (tp_replica_checkpoint.py), so each piece is written
        once. Unchanged without tp."""
        if self.tp_group is not None:
            for key in [key for key in ("model", "optimizer") if key in state]:
                state[key] = TPReplicaEntries(state[key], run_mesh=self.mesh)
        return state

    @torch.no_grad()
    def _sum_over_tp(self) -> None:
        """Every MoE parameter's gradient (experts, shared experts, router gate; local shards where sharded)
        summed over the tp ranks, in one all-reduce."""
        grads = [p.grad for moe in self.moes for p in moe.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not local:
            return
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self.tp_group)
        torch._foreach_copy_(local, [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in local]),
                                                                             local)])

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """After the step's last backward: expert gradients divided by grad_divisor (ep), and the replicated
        router gates' gradients averaged over the data-parallel ranks (like every other gradient, each rank's
        carries dp x its own tokens' share)."""
        experts = [w.grad for moe in self.moes for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)
                   if w.grad is not None]
        if experts:
            torch._foreach_div_(experts, float(self.grad_divisor))
        if self.tp_group is not None:  # each tp rank ran the MoE layers on its own sequence shard
            self._sum_over_tp()
        grads = [moe.router.gate.weight.grad for moe in self.moes if moe.router.gate.weight.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        for group in self.dp_groups:
            dist.all_reduce(flat, group=group)
        flat.div_(self.dp)
        pieces = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(pieces, grads)])


class ExpertBiasUpdate:
    """Aux-loss-free balancing: counts each MoE layer's routed tokens over a whole optimizer step (every
    microbatch, every data-parallel rank) and moves expert_bias towards the mean load after the step,
    identically on every rank.

    A forward hook adds each training forward's `tokens_per_expert` into a buffer of the layer
    (`step_tokens_per_expert`), so the count needs no call from the step's loop and covers the pipeline's
    microbatches, which its schedule runs in any order. Forwards that only recompute (activation
    checkpointing, inside the backward) are not counted. The count is a buffer so that torch's pipeline
    metadata inference, which runs a trial forward and restores the module buffers after it, leaves it
    unchanged. Under pipeline parallelism each rank updates its own stages' layers (the counts are
    summed over the data-parallel ranks of its pp slice, which hold the same layers)."""

    def __init__(self, moes: list[nn.Module], *, rate: float, groups: list[dist.ProcessGroup]):
        self.moes, self.rate, self.groups = moes, rate, groups
        if self.enabled:
            for moe in moes:
                moe.register_buffer("step_tokens_per_expert", torch.zeros_like(moe.tokens_per_expert,
                                                                              dtype=torch.float32), persistent=False)
                moe.register_forward_hook(_count_tokens)

    @property
    def enabled(self) -> bool:
        return bool(self.moes) and self.rate > 0

    @torch.no_grad()
    def update(self) -> None:
        """After the optimizer step: one all-reduce per data-parallel dimension for all layers, then the update."""
        if not self.enabled:
            return
        counts = torch.stack([moe.step_tokens_per_expert for moe in self.moes])
        for moe in self.moes:
            moe.step_tokens_per_expert.zero_()
        for group in self.groups:
            dist.all_reduce(counts, group=group)
        for moe, load in zip(self.moes, counts):
            dist_moe.update_expert_bias(moe.expert_bias, load, rate=self.rate)


def _count_tokens(moe: nn.Module, args, output) -> None:
    """Forward hook: a training forward's counts join the step's (see ExpertBiasUpdate)."""
    recomputing = torch._C._current_graph_task_id() != -1  # a forward run by the autograd engine (backward)
    if moe.training and torch.is_grad_enabled() and not recomputing and moe.tokens_per_expert.device.type != "meta":
        with torch.no_grad():
            moe.step_tokens_per_expert += moe.tokens_per_expert.float()


def prepare_moe_layers(model: nn.Module, config: TrainConfig) -> list[nn.Module]:
    """Swap in the configured MoE implementation (on the meta model) and return the MoE layers."""
    experts = config.quantize.experts
    if resolve_moe_impl(config) == "dist_moe":
        # The trainer sums the microbatches' gradients, so each carries 1 / grad_accum_steps of the weight.
        use_dist_moe(model, aux_loss_alpha=config.model.moe_aux_loss_weight / config.training.grad_accum_steps,
                     routing=config.model.moe_routing, quantize=experts,
                     keep_routed_input=config.model.moe_keep_routed_input)
    elif experts != "none":
        raise ValueError(f"quantize.experts={experts} runs in dist-moe's experts; it needs model.moe_impl=dist_moe "
                         f"(a MoE model), not {resolve_moe_impl(config)}")
    return moe_layers(model)
