"""The run's layout and the parallelized model it builds: `ParallelismConfig.build` makes a Parallelizer.

The Parallelizer checks the degrees against the rest of the recipe (before anything is allocated) and
builds the mesh; `build_model` then takes a titan-models config to a model that is built on meta,
cut to this rank's pipeline stages, wrapped (context, tensor and expert parallel, activation
checkpointing, compile, FSDP) and given weights that do not depend on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import titan_models as tm

from .compile_regions import apply_compile_regions
from .config import TrainConfig
from .context_parallel import apply_context_parallel, check_context_parallel
from .expert_parallel import (
    ExpertBiasUpdate,
    ExpertParallel,
    data_parallel_groups,
    prepare_moe_layers,
    resolve_moe_impl,
    split_balance_loss,
)
from .loss import CausalLMLoss
from .mesh import build_mesh, dp_rank, fsdp_mesh, resolve_degrees
from .model_setup import build_on_meta, materialize
from .parallelize import (
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tensor_parallel,
    check_moe_under_tp,
    check_tp_divisibility,
    keep_activations_in,
    tensor_parallel_styles,
)
from .pipeline import Pipeline, PipelineLayout, check_pipeline, keep_rank_part, materialize_rank_part, plan_layout
from .pipeline_overlap import check_pipeline_overlap
from .sharding_impl import apply_flexshard, check_sharding_choices


@dataclass(kw_only=True)
class ParallelModel:
    """What build_model returns: this rank's model and the wrappers a step runs it through."""

    model: nn.Module
    """The rank model (all of it, or this rank's pipeline stages), parallelized and materialized."""
    loss: CausalLMLoss
    """model + fused loss in one forward (what FSDP wraps when there is no pipeline)."""
    pipeline: Pipeline | None
    expert_parallel: ExpertParallel | None
    expert_bias: ExpertBiasUpdate
    autocast: bool
    """Run the forward under bf16 autocast (mixed_precision=bf16 without FSDP, whose policy casts instead)."""


class Parallelizer:
    """Degrees, mesh and this rank's coordinates for `run` on `world_size` ranks."""

    def __init__(self, run: TrainConfig, *, world_size: int, device: torch.device):
        self.run, self.device = run, device
        t, par = run.training, run.parallelism
        self.degrees = degrees = resolve_degrees(par, world_size)
        if t.batch_size % (degrees.dp * t.grad_accum_steps):
            raise ValueError(f"training.batch_size={t.batch_size} must be divisible by the data-parallel degree "
                             f"({degrees.dp}) x training.grad_accum_steps ({t.grad_accum_steps})")
        check_sharding_choices(run, dp_replicate=degrees.dp_replicate, tp=degrees.tp, ep=degrees.ep)
        if t.mixed_precision == "bf16_params":
            _check_bf16_params(run, world_size)
        resolve_moe_impl(run)
        check_pipeline_overlap(par)
        self.pp_settings = None
        if degrees.pp > 1:
            self.pp_settings = check_pipeline(par, pp=degrees.pp, rows=t.batch_size // degrees.dp,
                                              grad_accum_steps=t.grad_accum_steps,
                                              compiled=run.compile.uses_torch_compile)
        if degrees.cp > 1:
            check_context_parallel(cp=degrees.cp, tp=degrees.tp, seq_len=t.seq_len)
        if run.compile.effective_mode == "graph":
            from .graph.build import check_graph_mode

            check_graph_mode(run, degrees, device)
        self.mesh = build_mesh(degrees, device)
        self.dp_rank = dp_rank(self.mesh, degrees)
        self.precision = t.precision(device)
        self.compute_dtype = torch.bfloat16 if self.precision in ("bf16", "bf16_params") else torch.float32
        self.fsdp = degrees.dp * degrees.cp > 1  # cp ranks share the gradient reduction
        self.adapters = run.lora.build(seed=run.model.init_seed)  # LoRA, or None
        if self.adapters is not None and (degrees.tp > 1 or par.fsdp_impl == "flexshard"):
            raise ValueError("lora.targets: LoRA adapters compose with fully_shard FSDP and pipeline parallelism; "
                             "set parallelism.tp 1 and parallelism.fsdp_impl fully_shard")
        self.remat_plan: dict | None = None  # activation_checkpoint.mode=remat: the plan's report
        self.quantize = run.quantize.build()  # quantize.linear's conversion pass, or None
        self.quantized: list[str] = []  # the Linears it converted (build_model)

    def loss_scale(self, scored_tokens: int) -> float:
        """The factor each rank's summed loss is multiplied by before its backward: the one place the
        gradient scale of a layout is decided.

        The objective is the mean over the global batch's `scored_tokens`, so the gradients are the same
        whatever the layout. FSDP averages gradients over the dp x cp ranks (each saw other tokens), so
        the factor is dp x cp / scored_tokens. Expert shards (ep > 1) are the exception it cannot cover:
        their gradient already sums the ep ranks whose tokens they served (the all-to-all's backward) before
        FSDP averages over the remaining dp / ep, so it comes out ep times too large, and
        ExpertParallel.finish_gradients divides it by `expert_grad_divisor` (given at construction)."""
        return self.degrees.dp * self.degrees.cp / max(scored_tokens, 1)

    @property
    def expert_grad_divisor(self) -> int:
        """See loss_scale."""
        return self.degrees.ep

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype of the model's own parameters where it is not fp32 (bf16_params: the optimizer keeps
        the fp32 masters)."""
        return torch.bfloat16 if self.precision == "bf16_params" else None

    def build_model(self, model_cfg, *, document_masking: bool) -> ParallelModel:
        """This rank's parallelized model of `model_cfg`, with weights independent of the layout."""
        run, t = self.run, self.run.training
        model = build_on_meta(model_cfg)
        # on the whole model, so every rank agrees; what TP cannot split at all (DeepSeek-V4's one kv head) is
        # named before a MoE model's need for ep
        if self.degrees.tp > 1:
            check_tp_divisibility(model, self.degrees.tp, t.seq_len)
        check_moe_under_tp(model, tp=self.degrees.tp, ep=self.degrees.ep)
        if self.adapters is not None:  # on the whole model, so every pattern finds its Linears
            self.adapters.apply(model)
        layout = self._keep_rank_part(model)
        moes = prepare_moe_layers(model, run)  # model.moe_impl: titan-models' MoE or dist-moe's
        if self.quantize is not None:  # after the MoE swap (it rebuilds those layers), before every wrapper
            # a pipeline rank holds some stages only; under TP each rank's shard must be blockable
            styles = tensor_parallel_styles(model) if self.degrees.tp > 1 else None
            self.quantized = self.quantize.apply(model, partial=layout is not None, tp=self.degrees.tp,
                                                 tp_styles=styles)
        fused = t.fused_kernels and self.device.type == "cuda"
        if fused:  # before any wrapper, on titan-models' own FeedForwards
            from .kernels.swiglu import use_fused_swiglu

            use_fused_swiglu(model)
        loss = CausalLMLoss(
            model, chunk=t.loss_chunk_size, compiled=run.compile.uses_torch_compile, triton=fused,
            weight_grad_in_param_dtype=t.loss_weight_grad_dtype == "param",
            context_factory=(lambda ids: tm.AttentionContext(document_ids=ids)) if document_masking else None,
            tp_group=self.mesh["tp"].get_group() if self.degrees.tp > 1 else None)
        # bf16_params: the model itself holds bf16 weights (the optimizer keeps the fp32 masters), no autocast.
        autocast = self.precision == "bf16" and not self.fsdp  # FSDP casts through its policy
        if autocast:  # bf16 activations as under FSDP
            keep_activations_in(model, self.compute_dtype)
        if not dist.is_initialized():
            # init_weights seeds each parameter by its name: run it before wrappers rename blocks.
            materialize(model, model_cfg, device=self.device, seed=run.model.init_seed, distributed=False,
                        hf_path=run.model.hf_path, adapters=self.adapters)
        expert_parallel = self._wrap(model, moes)
        # the balance loss of MoE layers that see part of each sequence (cp chunks, tp shards under ep)
        split_balance_loss(moes, self.mesh, tp_sequence_shards=self.degrees.ep > 1)
        pipeline = None
        if layout is not None:
            pipeline = Pipeline(model, layout, schedule=self.pp_settings.schedule, loss=loss,
                                microbatches=self.pp_settings.microbatches, mesh=self.mesh, device=self.device,
                                autocast_dtype=torch.bfloat16 if autocast else None,
                                overlap_ep=run.parallelism.pp_overlap_ep)
        if self.fsdp:
            self._shard(loss, pipeline, expert_parallel)
        self._materialize(model, model_cfg, pipeline)
        counted_by = data_parallel_groups(self.mesh)
        if expert_parallel is not None and expert_parallel.tp_group is not None:  # tp ranks route their own shards
            counted_by.append(expert_parallel.tp_group)
        expert_bias = ExpertBiasUpdate(moes, rate=t.moe_bias_update_rate, groups=counted_by)
        return ParallelModel(model=model, loss=loss, pipeline=pipeline, expert_parallel=expert_parallel,
                             expert_bias=expert_bias, autocast=autocast)

    def _keep_rank_part(self, model: nn.Module) -> PipelineLayout | None:
        """Under pipeline parallelism keep this rank's stages only (names unchanged), still on meta."""
        if self.pp_settings is None:
            return None
        layout = plan_layout(model, pp=self.degrees.pp, schedule=self.pp_settings.schedule,
                             stages_per_rank=self.pp_settings.stages_per_rank)
        keep_rank_part(model, layout, self.mesh.get_local_rank("pp"))
        return layout

    def _wrap(self, model: nn.Module, moes: list[nn.Module]) -> ExpertParallel | None:
        """Context, tensor and expert parallel, activation checkpointing and compile, in the order each
        wrapper expects to find the model (parallelize.py)."""
        if self.degrees.cp > 1:
            apply_context_parallel(model, self.mesh["cp"].get_group())
        if self.degrees.tp > 1:
            # Under expert parallelism the MoE layers are not TP-split: each tp rank routes its own sequence
            # shard to the experts (ExpertParallel sums their gradients over tp).
            local = tuple(n for n, m in model.named_modules() if m in moes) if self.degrees.ep > 1 else ()
            apply_tensor_parallel(model, self.mesh["tp"], sequence_local=local)
        expert_parallel = None
        if self.degrees.ep > 1:
            expert_parallel = ExpertParallel(moes, self.mesh, self.degrees.ep, grad_divisor=self.expert_grad_divisor)
        if self.run.activation_checkpoint.mode == "remat":
            self._apply_remat(model)
        else:
            apply_activation_checkpointing(model, self.run.activation_checkpoint)
        if self.run.compile.uses_torch_compile:
            apply_compile_regions(model, self.run.compile)
        return expert_parallel

    def _apply_remat(self, model: nn.Module) -> None:
        """Per-op/per-block recomputation (remat/): planned for one microbatch of this rank against the peak
        model of remat/peak.py: the weights and AdamW moments (sharded over FSDP) through the forward, the
        gradients from the backward on (through the forward as well under gradient accumulation)."""
        from .memory_estimate import remat_static_memory
        from .remat import apply_remat

        t, d = self.run.training, self.degrees
        shards = d.dp * d.cp if self.fsdp else 1
        rows, seq_len = t.batch_size // d.dp // t.grad_accum_steps, t.seq_len // d.cp
        memory = remat_static_memory(self.run, model, device=self.device, shards=shards, tokens=rows * seq_len,
                                     autocast=self.precision == "bf16" and not self.fsdp)
        is_main = not dist.is_initialized() or dist.get_rank() == 0
        # compiled blocks save less than eager ones; profiled compiled only unsharded (meta DTensors aside)
        compiled = self.run.compile.effective_mode == "blocks" and d.tp == 1 and d.cp == 1
        self.remat_plan = apply_remat(model, self.run.activation_checkpoint, rows=rows, seq_len=seq_len,
                                      activation_dtype=self.compute_dtype, memory=memory,
                                      folder=Path(self.run.job.folder) if is_main else None, compiled=compiled)

    def _shard(self, loss: CausalLMLoss, pipeline: Pipeline | None, expert_parallel: ExpertParallel | None) -> None:
        """FSDP/HSDP over the data-parallel (x cp) mesh: MoE layers first (the blocks' units then leave them
        out), then the pipeline's stages, or the blocks and the loss wrapper as root."""
        par = self.run.parallelism
        dp_mesh = fsdp_mesh(self.mesh, self.degrees)
        param_dtype = self.compute_dtype if self.precision == "bf16" else None
        if expert_parallel is not None:
            expert_parallel.apply_fsdp(dp_mesh, param_dtype=param_dtype,
                                       reshard_after_forward=par.reshard_after_forward)
        if pipeline is not None:
            pipeline.apply_fsdp(dp_mesh, param_dtype=param_dtype, reshard_after_forward=par.reshard_after_forward)
        elif par.fsdp_impl == "flexshard":
            apply_flexshard(loss, dp_mesh, par, param_dtype=param_dtype, fp8_weights=self._fp8_gathered_weights())
        else:
            apply_fsdp(loss, list(loss.model.layers.values()), dp_mesh, param_dtype=param_dtype,
                       reshard_after_forward=par.reshard_after_forward)

    def _fp8_gathered_weights(self) -> tuple[str, ...]:
        """fp8_blockwise with flexshard's fp8 all-gather: the converted Linears' weights, which flexshard then
        gathers as e4m3 in the recipe's 128 x 128 blocks, fed to the forward GEMM as gathered (quantize/gathered.py)."""
        if not (self.run.parallelism.fp8_all_gather and self.run.quantize.linear == "fp8_blockwise"):
            return ()
        return tuple(f"{name}.weight" for name in self.quantized)

    def _materialize(self, model: nn.Module, model_cfg, pipeline: Pipeline | None) -> None:
        m = self.run.model
        if pipeline is not None:
            materialize_rank_part(model, model_cfg, device=self.device, seed=m.init_seed, hf_path=m.hf_path,
                                  adapters=self.adapters)
            pipeline.finish()
        elif dist.is_initialized():
            # Sharded while still on meta: each rank allocates only its shards, then copies them out
            # of rank 0's full initialisation.
            materialize(model, model_cfg, device=self.device, seed=m.init_seed, distributed=True, hf_path=m.hf_path,
                        adapters=self.adapters)


def _check_bf16_params(run: TrainConfig, world_size: int) -> None:
    t = run.training
    if world_size > 1:
        raise ValueError("training.mixed_precision=bf16_params is for one device; with several ranks use "
                         "bf16 (FSDP's bf16 policy gives the same arithmetic)")
    if t.grad_accum_steps > 1:
        raise ValueError("training.mixed_precision=bf16_params would sum microbatch gradients in bf16; use "
                         "grad_accum_steps=1 or mixed_precision=bf16")
    if run.optimizer.name != "adamw":
        raise ValueError("training.mixed_precision=bf16_params keeps its master weights in AdamW; use "
                         "optimizer.name=adamw, or mixed_precision=bf16 with muon")
