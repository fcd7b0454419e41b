"""The training loop: data -> (FSDP/TP) model + fused chunked loss -> clip -> AdamW -> schedule, with
metrics, progress, checkpoint/resume and a stop on a non-finite loss."""
from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import titan_models as tm
import torch
import torch.distributed as dist

from .config import TrainConfig
from .context_parallel import apply_context_parallel, check_context_parallel, local_indices, shard_sequence
from .data import IGNORE_INDEX, PackedLoader, RandomTokenLoader, build_tokenizer, open_documents
from .expert_parallel import (
    ExpertBiasUpdate, ExpertParallel, data_parallel_groups, prepare_moe_layers, resolve_moe_impl,
)
from .grad_norm import clip_by_total_norm
from .loss import CausalLMLoss
from .lr_schedule import lr_factor, validate as validate_schedule
from .mesh import build_mesh, dp_rank, fsdp_mesh, resolve_degrees
from .metrics import MetricsWriter, memory_gib, peak_flops
from .model_setup import build_on_meta, materialize, model_config
from .overrides import check_types
from .parallelize import (
    apply_activation_checkpointing, apply_compile, apply_fsdp, apply_tensor_parallel, check_tp_divisibility,
    keep_activations_in,
)
from .optimizers import build_optimizer
from .pipeline import Pipeline, check_pipeline, keep_rank_part, materialize_rank_part, plan_layout
from .progress import ProgressBar
from .sharding_impl import apply_flexshard, check_sharding_choices


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) of a step was NaN or inf; the step was not applied nor checkpointed."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        what = "loss" if not torch.isfinite(torch.tensor(loss)) else "gradient norm"
        super().__init__(f"non-finite {what} at step {step} (loss {loss}, grad norm {grad_norm}); the step was "
                         "not applied and no checkpoint was written for it")


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    """step -> global mean loss, for the steps this call ran."""
    start_step: int = 0
    """The step the run resumed from (0 for a fresh run)."""
    tokens_per_s: float = 0.0
    """Mean throughput over the steps after the first (which includes warm-up)."""
    folder: Path = Path(".")


def _select_device(config: TrainConfig) -> torch.device:
    kind = config.job.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("job.device=cuda but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@contextlib.contextmanager
def _process_group(device: torch.device):
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU) unless one exists already."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    created = False
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def train(config: TrainConfig) -> TrainResult:
    """Run the training job `config` describes (under torchrun: this process's rank of it)."""
    check_types(config)
    device = _select_device(config)
    with _process_group(device):
        return Trainer(config, device).run()


class Trainer:
    """One rank's share of a run: data, parallelized model, optimizer, schedule and checkpoints, built
    from the config (everything the user can get wrong is checked before the model is built)."""

    def __init__(self, config: TrainConfig, device: torch.device):
        self.config, self.device = config, device
        t, par, c = config.training, config.parallelism, config.checkpoint
        validate_schedule(config.lr_schedule)
        if c.interval < 0 or c.keep_last < 0:
            raise ValueError("checkpoint.interval and checkpoint.keep_last must be >= 0")
        if t.gc_interval < 0:
            raise ValueError(f"training.gc_interval must be >= 0 (0: automatic collection), got {t.gc_interval}")
        if config.metrics.log_interval < 1:
            raise ValueError(f"metrics.log_interval must be >= 1, got {config.metrics.log_interval}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.degrees = resolve_degrees(par, world)
        for name in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
            if getattr(t, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(t, name)}")
        if t.batch_size % (self.degrees.dp * t.grad_accum_steps):
            raise ValueError(f"training.batch_size={t.batch_size} must be divisible by the data-parallel degree "
                             f"({self.degrees.dp}) x training.grad_accum_steps ({t.grad_accum_steps})")
        check_sharding_choices(config, dp_replicate=self.degrees.dp_replicate, tp=self.degrees.tp, ep=self.degrees.ep)
        if t.mixed_precision == "bf16_params":
            self._check_bf16_params(world)
        resolve_moe_impl(config)
        self.pp_settings = None
        if self.degrees.pp > 1:
            self.pp_settings = check_pipeline(par, pp=self.degrees.pp, rows=t.batch_size // self.degrees.dp,
                                              grad_accum_steps=t.grad_accum_steps, compiled=config.compile.enabled)
        if self.degrees.cp > 1:
            check_context_parallel(cp=self.degrees.cp, tp=self.degrees.tp, seq_len=t.seq_len)
        self.mesh = build_mesh(self.degrees, device)
        self.dp_rank = dp_rank(self.mesh, self.degrees)
        self.folder = Path(config.job.folder)
        torch.manual_seed(config.job.seed)

        # Data: every rank reads the global stream and keeps its rows (see data/loader.py).
        random_data = config.data.source == "random"
        self.tokenizer = None if random_data else build_tokenizer(config.data.tokenizer)
        self.model_cfg = model_config(config.model, vocab_needed=0 if random_data else self.tokenizer.vocab_size)
        if random_data:
            self.loader = RandomTokenLoader(self.model_cfg.vocab_size, seq_len=t.seq_len, seed=config.job.seed)
        else:
            documents = open_documents(config.data.source, format=config.data.format,
                                       text_field=config.data.text_field, split=config.data.split)
            self.loader = PackedLoader(documents, self.tokenizer, seq_len=t.seq_len, seed=config.job.seed,
                                       shuffle=config.data.shuffle, document_masking=config.data.document_masking)

        # Model: built on meta, parallelized, then given weights that do not depend on the layout.
        model = build_on_meta(self.model_cfg)
        layout = None
        if self.pp_settings is not None:  # keep this rank's stages only (names unchanged), still on meta
            layout = plan_layout(model, pp=self.degrees.pp, schedule=self.pp_settings.schedule,
                                 stages_per_rank=self.pp_settings.stages_per_rank)
            keep_rank_part(model, layout, self.mesh.get_local_rank("pp"))
        moes = prepare_moe_layers(model, config)  # model.moe_impl: titan-models' MoE or dist-moe's
        if layout is not None and moes and t.moe_bias_update_rate > 0:
            raise ValueError("parallelism.pp > 1 with MoE layers: the expert-bias update does not count the "
                             "pipeline's microbatches yet; set training.moe_bias_update_rate 0")
        self.loss_module = CausalLMLoss(model, chunk=t.loss_chunk_size)
        if t.fused_kernels and device.type == "cuda":  # before any wrapper, on titan-models' own FeedForwards
            from .kernels.swiglu import use_fused_swiglu

            use_fused_swiglu(model)
            self.loss_module.triton = True
        if config.data.document_masking and not random_data:
            self.loss_module.context_factory = lambda ids: tm.AttentionContext(document_ids=ids)
        precision = t.mixed_precision if t.mixed_precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
        self.compute_dtype = torch.bfloat16 if precision in ("bf16", "bf16_params") else torch.float32
        self.fsdp = self.degrees.dp * self.degrees.cp > 1  # cp ranks share the gradient reduction
        # bf16_params: the model itself holds bf16 weights (the optimizer keeps the fp32 masters), no autocast.
        self.autocast = precision == "bf16" and not self.fsdp  # FSDP casts through its policy
        if self.autocast:  # bf16 activations as under FSDP
            keep_activations_in(model, self.compute_dtype)
        distributed = dist.is_initialized()
        if not distributed:
            # init_weights seeds each parameter by its name: run it before wrappers rename blocks.
            materialize(model, self.model_cfg, device=device, seed=config.model.init_seed, distributed=False,
                        hf_path=config.model.hf_path)
        if self.degrees.cp > 1:
            apply_context_parallel(model, self.mesh["cp"].get_group())
        if self.degrees.tp > 1:
            check_tp_divisibility(model, self.degrees.tp, t.seq_len)
            apply_tensor_parallel(self.loss_module, self.mesh["tp"])
        self.expert_parallel = ExpertParallel(moes, self.mesh, self.degrees.ep) if self.degrees.ep > 1 else None
        apply_activation_checkpointing(model, config.activation_checkpoint)
        if config.compile.enabled:
            apply_compile(model)
            self.loss_module.compiled = True
        self.pipeline = None
        if layout is not None:
            self.pipeline = Pipeline(
                model, layout, schedule=self.pp_settings.schedule, microbatches=self.pp_settings.microbatches,
                mesh=self.mesh, device=device, chunk=t.loss_chunk_size, tp_group=self.loss_module.tp_group,
                context_factory=self.loss_module.context_factory, compiled_loss=self.loss_module.compiled,
                triton_loss=self.loss_module.triton,
                autocast_dtype=torch.bfloat16 if self.autocast else None)
        if self.fsdp:
            dp_mesh = fsdp_mesh(self.mesh, self.degrees)
            param_dtype = self.compute_dtype if precision == "bf16" else None
            if self.expert_parallel is not None:  # MoE layers first: the blocks' units then leave them out
                self.expert_parallel.apply_fsdp(dp_mesh, param_dtype=param_dtype,
                                                reshard_after_forward=par.reshard_after_forward)
            if self.pipeline is not None:
                self.pipeline.apply_fsdp(dp_mesh, param_dtype=param_dtype,
                                         reshard_after_forward=par.reshard_after_forward)
            elif par.fsdp_impl == "flexshard":
                apply_flexshard(self.loss_module, dp_mesh, par, param_dtype=param_dtype)
            else:
                apply_fsdp(self.loss_module, dp_mesh, reshard_after_forward=par.reshard_after_forward,
                           param_dtype=param_dtype)
        if self.pipeline is not None:
            materialize_rank_part(model, self.model_cfg, device=device, seed=config.model.init_seed,
                                  hf_path=config.model.hf_path)
            self.pipeline.finish()
        elif distributed:
            # Sharded while still on meta: each rank allocates only its shards, then copies them out
            # of rank 0's full initialisation.
            materialize(model, self.model_cfg, device=device, seed=config.model.init_seed, distributed=True,
                        hf_path=config.model.hf_path)
        torch.manual_seed(config.job.seed)  # rank 0's reference build drew from it: realign every rank
        self.model = model

        # Optimizer and schedule.
        self.optimizer = build_optimizer(config.optimizer, model, device=device,
                                         param_dtype=torch.bfloat16 if precision == "bf16_params" else None)
        self.expert_bias = ExpertBiasUpdate(moes, rate=t.moe_bias_update_rate, groups=data_parallel_groups(self.mesh))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, t.steps, config.lr_schedule))

        self.checkpoints = None
        if c.interval > 0 or c.resume:
            from .checkpoint import RunCheckpoints  # torch-checkpointing is only needed when checkpointing

            self.checkpoints = RunCheckpoints(
                self.folder / "checkpoints", keep_last=c.keep_last, async_save=c.async_save,
                adapt=self.pipeline.checkpoint_entries if self.pipeline is not None else None)
        self.flops_per_token = tm.flops_per_token(self.model_cfg, t.seq_len)
        self.peak = peak_flops(device)

    def _check_bf16_params(self, world: int) -> None:
        t, c = self.config.training, self.config
        if world > 1:
            raise ValueError("training.mixed_precision=bf16_params is for one device; with several ranks use "
                             "bf16 (FSDP's bf16 policy gives the same arithmetic)")
        if t.grad_accum_steps > 1:
            raise ValueError("training.mixed_precision=bf16_params would sum microbatch gradients in bf16; use "
                             "grad_accum_steps=1 or mixed_precision=bf16")
        if c.optimizer.name != "adamw":
            raise ValueError("training.mixed_precision=bf16_params keeps its master weights in AdamW; use "
                             "optimizer.name=adamw, or mixed_precision=bf16 with muon")

    # --- one optimizer step -------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> tuple[float, float]:
        """Forward/backward over this step's batch, clip, update. Returns (loss, grad_norm)."""
        t = self.config.training
        batch = self.loader.next_batch(t.batch_size)  # the global batch, on every rank
        # Normalise by the global count of scored tokens, so the loss and its gradient are the same
        # whatever the layout; FSDP averages gradients over dp x cp ranks, so scale by that to get the sum.
        scored = int((batch.labels != IGNORE_INDEX).sum())
        scale = self.degrees.dp * self.degrees.cp / max(scored, 1)
        rows = t.batch_size // self.degrees.dp
        local = batch.rows(self.dp_rank * rows, (self.dp_rank + 1) * rows).to(self.device)
        positions = None
        if self.degrees.cp > 1:  # this cp rank's two load-balanced chunks of every sequence
            cp_rank = self.mesh.get_local_rank("cp")
            local = type(local)(*shard_sequence(cp_rank, self.degrees.cp, local.tokens, local.labels,
                                                local.document_ids))
            positions = local_indices(cp_rank, self.degrees.cp, t.seq_len, self.device).expand(rows, -1)
        micro_rows = rows // t.grad_accum_steps
        if self.pipeline is not None:  # the schedule splits the rows into microbatches, FSDP reduces once
            if positions is None:
                positions = torch.arange(t.seq_len, device=self.device).expand(rows, -1)
            loss_sum = self.pipeline.step(local.tokens, local.labels, positions, local.document_ids, scale=scale)
        else:
            loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
            for i in range(t.grad_accum_steps):
                micro = local.rows(i * micro_rows, (i + 1) * micro_rows)
                micro_positions = None if positions is None else positions[i * micro_rows:(i + 1) * micro_rows]
                if self.fsdp and self.config.parallelism.fsdp_impl == "fully_shard":  # reduce once, after the last
                    self.loss_module.set_requires_gradient_sync(i == t.grad_accum_steps - 1)  # (flexshard: every one)
                with self._autocast():
                    micro_loss = self.loss_module(micro.tokens, micro.labels, micro.document_ids, micro_positions)
                (micro_loss * scale).backward()
                loss_sum += micro_loss.detach().float()
                self.expert_bias.accumulate()
        if self.expert_parallel is not None:
            self.expert_parallel.finish_gradients()
        grad_norm = self._clip_gradients()
        if dist.is_initialized():
            dist.all_reduce(loss_sum)  # dp ranks hold other rows, tp ranks other sequence slices
        loss, norm = torch.stack([loss_sum / max(scored, 1), grad_norm.float()]).tolist()
        if not (torch.isfinite(torch.tensor(loss)) and torch.isfinite(torch.tensor(norm))):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(step, loss, norm)
        if self.checkpoints is not None:  # the last save's device-to-host copies overlapped this forward and backward
            self.checkpoints.before_optimizer_step()
        self.optimizer.step()
        self.expert_bias.update()  # after the step, as aux-loss-free balancing prescribes
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def _clip_gradients(self) -> torch.Tensor:
        if self.pipeline is not None:  # each pp rank holds other stages: the norm is reduced over pp too
            return self.pipeline.clip_gradients(list(self.model.parameters()), self.config.training.max_grad_norm)
        return clip_by_total_norm(list(self.model.parameters()), self.config.training.max_grad_norm)

    # --- the run ------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        config, t = self.config, self.config.training
        start = 0
        if self.checkpoints is not None and config.checkpoint.resume and self.checkpoints.latest_step() is not None:
            start = self.checkpoints.restore(self.model, self.optimizer, self.scheduler, self.loader, self.device)
        result = TrainResult(start_step=start, folder=self.folder)
        is_main = self.rank == 0
        metrics = (MetricsWriter(self.folder, tensorboard=config.metrics.tensorboard, start_step=start)
                   if is_main else None)
        bar = ProgressBar(t.steps, start=start, enabled=is_main and config.metrics.progress)
        if is_main:
            self._announce(start)
        tokens_per_step = t.batch_size * t.seq_len
        timed_tokens, timed_seconds = 0, 0.0
        collect_automatically = gc.isenabled()
        if t.gc_interval:
            gc.disable()
        try:
            for step in range(start + 1, t.steps + 1):
                lr = self.scheduler.get_last_lr()[0]
                began = time.perf_counter()
                loss, grad_norm = self.train_step(step)
                if self.checkpoints is not None and config.checkpoint.interval and step == start + 1:
                    self.checkpoints.reserve(self.checkpoints.state(  # the state now has its optimizer moments
                        self.model, self.optimizer, self.scheduler, self.loader, step, self.device))
                if t.gc_interval and step % t.gc_interval == 0:  # the optimizer step is still queued on the GPU
                    gc.collect(1)
                seconds = time.perf_counter() - began
                result.losses[step] = loss
                if step > start + 1:
                    timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + seconds
                tokens_per_s = tokens_per_step / seconds
                world = dist.get_world_size() if dist.is_initialized() else 1
                mfu = self.flops_per_token * tokens_per_s / (self.peak * world) if self.peak else None
                if is_main and (step % config.metrics.log_interval == 0 or step == t.steps):
                    mem = memory_gib(self.device)
                    metrics.write({"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "lr": lr,
                                   "grad_norm": grad_norm, "mfu": mfu, "memory_gib": mem, "step_seconds": seconds})
                    bar.update(step, loss=loss, tokens_per_s=tokens_per_s, mfu=mfu, memory_gib=mem)
                interval = config.checkpoint.interval
                if self.checkpoints is not None and interval and (step % interval == 0 or step == t.steps):
                    self.checkpoints.save(step, self.checkpoints.state(
                        self.model, self.optimizer, self.scheduler, self.loader, step, self.device))
        finally:
            if collect_automatically:
                gc.enable()
            bar.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
            if metrics is not None:
                metrics.close()
        result.tokens_per_s = timed_tokens / timed_seconds if timed_seconds else 0.0
        if is_main:
            self._summarize(result)
        return result

    def _announce(self, start: int) -> None:
        c, d = self.config, self.degrees
        n_params = tm.count_params(self.model_cfg).total
        resumed = f", resuming after step {start}" if start else ""
        model_name = c.model.hf_path or f"{c.model.family} {c.model.flavor}"
        print(f"titan-train: {model_name} ({n_params / 1e6:.1f}M parameters) on {self.device.type}, "
              f"pp={d.pp} dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} cp={d.cp} tp={d.tp}; "
              f"{c.training.steps} steps of {c.training.batch_size} x {c.training.seq_len} tokens from "
              f"{c.data.source}{resumed}; metrics in {self.folder / 'metrics.jsonl'}", flush=True)

    def _summarize(self, result: TrainResult) -> None:
        if not result.losses:
            print(f"titan-train: nothing to do, the run already reached step {result.start_step}")
            return
        steps = sorted(result.losses)
        head = [result.losses[s] for s in steps[:5]]
        tail = [result.losses[s] for s in steps[-5:]]
        print(f"titan-train: done, steps {steps[0]}-{steps[-1]}: loss {sum(head) / len(head):.3f} (first 5) -> "
              f"{sum(tail) / len(tail):.3f} (last 5), {result.tokens_per_s:.0f} tokens/s; "
              f"metrics in {self.folder / 'metrics.jsonl'}", flush=True)
