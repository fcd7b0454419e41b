"""The training loop: data -> (FSDP/TP) model + fused chunked loss -> clip -> AdamW -> schedule, with
metrics, progress, checkpoint/resume and a stop on a non-finite loss."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import titan_models as tm

from .cli_args import check_types
from .config import TrainConfig
from .context_parallel import local_indices, shard_sequence
from .data import IGNORE_INDEX, Batch
from .field_checks import check_run_fields
from .grad_norm import clip_by_total_norm
from .memory_estimate import check_memory_fits
from .metrics import memory_gib, memory_reserved_gib, peak_flops
from .model_setup import model_config
from .multi_token import MTPBatch, mtp_batch, mtp_objective, mtp_weight
from .nonfinite import NonFiniteGuard, NonFiniteLossError
from .optimizer_settings import OptimizerSettings
from .process_group import process_group, select_device
from .progress import ProgressBar
from .run_folder import check_run_folder, claim_run_folder
from .saved_config import save_config


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    """step -> global mean loss, for the steps this call ran."""
    start_step: int = 0
    """The step the run resumed from (0 for a fresh run)."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    """step -> validation loss, for the steps that evaluated."""
    tokens_per_s: float = 0.0
    """Mean throughput over the steps after the first (which includes warm-up)."""
    folder: Path = Path(".")


def train(config: TrainConfig) -> TrainResult:
    """Run the training job `config` describes (under torchrun: this process's rank of it)."""
    check_types(config)
    device = select_device(config.job.device)
    with process_group(device):
        return Trainer(config, device).run()


class Trainer:
    """One rank's share of a run: data, parallelized model, optimizer, schedule and checkpoints, each built
    by its config section (everything the user can get wrong is checked before the model is built)."""

    def __init__(self, config: TrainConfig, device: torch.device):
        self.config, self.device = config, device
        t = config.training
        config.check()
        check_run_fields(config)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.parallelizer = layout = config.parallelism.build(config, world_size=world, device=device)
        self.degrees, self.mesh, self.dp_rank = layout.degrees, layout.mesh, layout.dp_rank
        if config.data.source == "shapes" and (self.degrees.pp > 1 or self.degrees.cp > 1 or self.degrees.tp > 1):
            raise ValueError("data.source=shapes (image-text) trains with data parallelism (FSDP) only for now; "
                             f"got pp={self.degrees.pp}, cp={self.degrees.cp}, tp={self.degrees.tp}")
        self.folder = Path(config.job.folder)
        check_run_folder(self.folder, resume=config.checkpoint.resume, device=device)  # refuse before the build
        torch.manual_seed(config.job.seed)
        # Data: every rank reads the global stream and keeps its rows (see data/loader.py).
        self.tokenizer = config.data.build_tokenizer()
        vocab_needed = 0 if self.tokenizer is None else self.tokenizer.vocab_size
        self.model_cfg = model_config(config.model, vocab_needed=vocab_needed)
        self.model_cfg_mtp = bool(getattr(self.model_cfg, "mtp", False))  # model.mtp_layers > 0
        check_memory_fits(config, self.model_cfg, self.degrees, device=device,
                          n_params=tm.count_params(self.model_cfg).total)
        self.loader = config.data.build(self.tokenizer, vocab_size=self.model_cfg.vocab_size, seq_len=t.seq_len,
                                        seed=config.job.seed, model_config=self.model_cfg)
        self.validator = config.validation.build(config.data, self.tokenizer, seq_len=t.seq_len,
                                                 batch_size=t.batch_size, seed=config.job.seed)
        # Model: built on meta, parallelized, then given weights that do not depend on the layout.
        self.parallel = self.parallelizer.build_model(
            self.model_cfg, document_masking=config.data.document_masking and not config.data.random)
        self.model, self.loss_module, self.pipeline = self.parallel.model, self.parallel.loss, self.parallel.pipeline
        if config.checkpoint.initial_load:  # before a resume, which loads over it (LoRA: the adapters only)
            from .initial_weights import load_initial_weights

            load_initial_weights(self.model, config.checkpoint.initial_load, pipeline=self.pipeline)
        self.graph_step = None  # compile.mode=graph: the captured step runs instead of eager autograd
        if config.compile.effective_mode == "graph":
            from .graph.build import build_graph_step

            self.graph_step = build_graph_step(config, self.loss_module, folder=self.folder,
                                               is_main=self.rank == 0, autocast=self._autocast)
        torch.manual_seed(config.job.seed)  # rank 0's reference build drew from it: realign every rank
        self.optimizer = config.optimizer.build(self.model, device=device, param_dtype=self.parallelizer.param_dtype)
        self.scheduler = config.lr_schedule.build(self.optimizer, total_steps=t.steps)
        self.graph_optimizer = None  # compile.graph_optimizer: the captured AdamW update runs instead of step()
        if self.graph_step is not None and config.compile.graph_optimizer:
            from .graph.build import build_graph_optimizer

            self.graph_optimizer = build_graph_optimizer(config, self.optimizer, folder=self.folder,
                                                         is_main=self.rank == 0, device=device)
        self.guard = NonFiniteGuard(self.optimizer, device)
        self.optimizer_settings = OptimizerSettings(self.optimizer)  # the config's, re-applied after a resume
        # the run folder is claimed before anything writes there
        self.run_lock = claim_run_folder(self.folder, resume=config.checkpoint.resume, device=device)
        self.checkpoints = config.checkpoint.build(self.folder / "checkpoints", adapt=self._checkpoint_entries(),
                                                   trainable_only=self.parallelizer.adapters is not None)
        self.profiler = config.profiling.build(self.folder, rank=self.rank, device=device)
        if config.checkpoint.export_hf_at_end and self.pipeline is not None:
            raise ValueError("checkpoint.export_hf_at_end with parallelism.pp > 1: export the last checkpoint with "
                             "titan-train export --job.folder DIR --out HF_DIR instead")
        if self.rank == 0:
            save_config(config, self.folder)  # what titan-train export rebuilds the model from
        # MTP's block and second output projection are work the step does (model.mtp_layers > 0)
        self.flops_per_token = tm.flops_per_token(self.model_cfg, t.seq_len, include_mtp=self.model_cfg_mtp)
        self.peak = peak_flops(device)

    # --- one optimizer step -------------------------------------------------------------------------
    def _autocast(self):
        if self.parallel.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _checkpoint_entries(self) -> Callable[[dict], dict] | None:
        """How the checkpoint state is rewritten so the ranks' entries fit together: the expert shards every tp
        rank holds whole (replicated over tp), then the pipeline's stages (placeholders for other ranks')."""
        rewrites = [owner.checkpoint_entries for owner in (self.parallel.expert_parallel, self.pipeline)
                    if owner is not None]

        def adapt(state: dict) -> dict:
            for rewrite in rewrites:
                state = rewrite(state)
            return state

        return adapt if rewrites else None

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward/backward over this step's batch, clip, update. Returns (loss, grad_norm, mtp_loss), 0-dim
        tensors that may still be computing (NonFiniteGuard says when a non-finite one stops the run);
        mtp_loss is 0 without multi-token prediction."""
        t = self.config.training
        batch = self.loader.next_batch(t.batch_size)  # the global batch, on every rank
        scored = int((batch.labels != IGNORE_INDEX).sum())
        scale = self.parallelizer.loss_scale(scored)
        mtp, mtp_scored, weight = None, 0, 0.0
        if self.model_cfg_mtp:
            mtp = mtp_batch(batch.tokens, batch.labels, batch.document_ids)
            mtp_scored = int((mtp.labels != IGNORE_INDEX).sum())
            weight = mtp_weight(t.mtp_loss_weight, scored=scored, mtp_scored=mtp_scored)
        local, positions = self._local_rows(batch)
        rows = local.tokens.shape[0]
        if mtp is not None:
            mtp = self._local_mtp(mtp, rows)
        if self.pipeline is not None:  # the schedule splits the rows into microbatches, FSDP reduces once
            if positions is None:
                positions = torch.arange(t.seq_len, device=self.device).expand(rows, -1)
            sums = self.pipeline.step(local.tokens, local.labels, positions, local.document_ids, scale=scale,
                                      mtp=mtp, mtp_weight=weight)
        else:
            sums = self._accumulate(local, positions, mtp, scale=scale, mtp_weight=weight)
        if self.parallel.expert_parallel is not None:
            self.parallel.expert_parallel.finish_gradients()
        grad_norm = self._clip_gradients()
        if dist.is_initialized():
            dist.all_reduce(sums)  # dp and cp ranks hold other tokens, pp ranks other stages
            if self.degrees.tp > 1:
                sums /= self.degrees.tp  # tp ranks all hold the same (vocabulary-parallel) loss
        loss, mtp_loss = sums[0] / max(scored, 1), sums[1] / max(mtp_scored, 1)
        try:
            self.guard.before_update(step, loss, grad_norm)
        except NonFiniteLossError:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        if self.checkpoints is not None:  # the last save's device-to-host copies overlapped this forward and backward
            self.checkpoints.before_optimizer_step()
        (self.graph_optimizer or self.optimizer).step()
        self.parallel.expert_bias.update()  # after the step, as aux-loss-free balancing prescribes
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, mtp_loss

    def _accumulate(self, local, positions: torch.Tensor | None, mtp: MTPBatch | None, *, scale: float,
                    mtp_weight: float) -> torch.Tensor:
        """Forward/backward of this rank's rows, training.grad_accum_steps microbatches at a time; returns
        the summed (main, MTP) losses [2] of those rows."""
        steps = self.config.training.grad_accum_steps
        micro_rows = local.tokens.shape[0] // steps
        sums = torch.zeros(2, device=self.device, dtype=torch.float32)
        for i in range(steps):
            rows = slice(i * micro_rows, (i + 1) * micro_rows)
            micro = local.rows(rows.start, rows.stop)
            micro_positions = None if positions is None else positions[rows]
            extra = {} if mtp is None else {"mtp_tokens": mtp.tokens[rows], "mtp_labels": mtp.labels[rows]}
            # fully_shard reduces once, after the last microbatch (flexshard: after every one)
            if self.parallelizer.fsdp and self.config.parallelism.fsdp_impl == "fully_shard":
                self.loss_module.set_requires_gradient_sync(i == steps - 1)
            if self.graph_step is not None:  # compile.mode graph: the captured step (its backward included)
                micro_sums = self.graph_step(micro.tokens, micro.labels, micro.document_ids, micro_positions, scale,
                                             **extra, mtp_weight=mtp_weight, last=i == steps - 1)
            else:
                with self._autocast():
                    micro_sums = self.loss_module(micro.tokens, micro.labels, micro.document_ids, micro_positions,
                                                  **extra, **micro.image_inputs())
                objective = micro_sums if mtp is None else mtp_objective(micro_sums, mtp_weight)
                (objective * scale).backward()
            if mtp is None:
                sums[0] += micro_sums.detach().float()
            else:  # (main, MTP) sums
                sums += micro_sums.detach().float()
        return sums

    def _local_rows(self, batch: Batch) -> tuple[Batch, torch.Tensor | None]:
        """This rank's rows of the global batch on the device (under cp: its chunks of each sequence, and
        their positions)."""
        t = self.config.training
        rows = t.batch_size // self.degrees.dp
        local = batch.rows(self.dp_rank * rows, (self.dp_rank + 1) * rows).to(self.device)
        positions = None
        if self.degrees.cp > 1:  # this cp rank's two load-balanced chunks of every sequence
            cp_rank = self.mesh.get_local_rank("cp")
            local = type(local)(*shard_sequence(cp_rank, self.degrees.cp, local.tokens, local.labels,
                                                local.document_ids))
            positions = local_indices(cp_rank, self.degrees.cp, t.seq_len, self.device).expand(rows, -1)
        return local, positions

    def _local_mtp(self, mtp: MTPBatch, rows: int) -> MTPBatch:
        """This rank's rows of the global batch's MTP inputs and targets, under cp its chunks of each sequence.
        They were shifted on whole sequences (mtp_batch), so token i + 1 and i + 2 of a position at the end
        of one chunk come from the next chunk, which may live on another cp rank."""
        mtp = mtp.rows(self.dp_rank * rows, (self.dp_rank + 1) * rows).to(self.device)
        if self.degrees.cp == 1:
            return mtp
        return MTPBatch(*shard_sequence(self.mesh.get_local_rank("cp"), self.degrees.cp, mtp.tokens, mtp.labels))

    @torch.no_grad()
    def summed_loss(self, batch: Batch) -> torch.Tensor:
        """The summed loss of a global batch over every rank's tokens, forward only, in eval mode (no dropout:
        LoRA's) (validation)."""
        self.model.eval()
        try:
            return self._summed_loss(batch)
        finally:
            self.model.train()

    def _summed_loss(self, batch: Batch) -> torch.Tensor:
        local, positions = self._local_rows(batch)
        if self.pipeline is not None:
            if positions is None:
                positions = torch.arange(local.tokens.shape[1], device=self.device).expand_as(local.tokens)
            loss_sum = self.pipeline.evaluate(local.tokens, local.labels, positions, local.document_ids)
        else:
            with self._autocast():
                loss_sum = self.loss_module(local.tokens, local.labels, local.document_ids, positions).float()
        if dist.is_initialized():
            dist.all_reduce(loss_sum)
            if self.degrees.tp > 1:
                loss_sum /= self.degrees.tp
        return loss_sum

    def _clip_gradients(self) -> torch.Tensor:
        # Reading the norm skips the multiplication of gradients within the bound (by exactly 1). On the guard's
        # device path it is not read (no sync) unless every step is read back anyway (log_interval 1).
        read_norm = not self.guard.on_device or self.config.metrics.log_interval == 1
        params, max_norm = list(self.model.parameters()), self.config.training.max_grad_norm
        if self.pipeline is not None:  # each pp rank holds other stages: the norm is reduced over pp too
            return self.pipeline.clip_gradients(params, max_norm, read_norm=read_norm)
        return clip_by_total_norm(params, max_norm, read_norm=read_norm)

    # --- the run ------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _run(self) -> TrainResult:
        config, t = self.config, self.config.training
        start, settings_changed = self._resume()
        result = TrainResult(start_step=start, folder=self.folder)
        is_main = self.rank == 0
        metrics = (config.metrics.build(self.folder, start_step=start, run_config=dataclasses.asdict(config))
                   if is_main else None)
        bar = ProgressBar(t.steps, start=start, enabled=is_main and config.metrics.progress)
        if is_main:
            self._announce(start, settings_changed)
        timing = _Timing()
        pending: list[_PendingStep] = []  # the steps since the last read-back
        collect_automatically = gc.isenabled()
        if t.gc_interval:
            gc.disable()
        try:
            for step in range(start + 1, t.steps + 1):
                if self.checkpoints is not None:  # a failed asynchronous save stops the run here
                    self.checkpoints.poll()
                lr = self.scheduler.get_last_lr()[0]
                began = time.perf_counter()
                self.profiler.before(step)
                loss, grad_norm, mtp_loss = self.train_step(step)
                self.profiler.after(step)
                if self.checkpoints is not None and config.checkpoint.interval and step == start + 1:
                    self.checkpoints.reserve(self.checkpoints.state(  # the state now has its optimizer moments
                        self.model, self.optimizer, self.scheduler, self.loader, step, self.device))
                if t.gc_interval and step % t.gc_interval == 0:  # the optimizer step is still queued on the GPU
                    gc.collect(1)
                pending.append(_PendingStep(step, lr, loss, grad_norm, mtp_loss, time.perf_counter() - began))
                evaluate = self.validator is not None and self.validator.due(step, t.steps)
                log = step % config.metrics.log_interval == 0 or step == t.steps or evaluate
                interval = config.checkpoint.interval
                save = self.checkpoints is not None and interval and (step % interval == 0 or step == t.steps)
                if log or save:  # the only host syncs of the loop; a non-finite step stops the run here
                    record = self._read_back(pending, result, timing, first=start + 1)
                    pending = []
                    if evaluate:
                        record.update(self.validator.evaluate(self.summed_loss))
                        result.eval_losses[step] = record["eval_loss"]
                    if log and is_main:
                        metrics.write(record)
                        bar.update(step, loss=record["loss"], tokens_per_s=record["tokens_per_s"], mfu=record["mfu"],
                                   memory_gib=record["memory_gib"], mtp_loss=record.get("mtp_loss"))
                if save:
                    self.checkpoints.save(step, self.checkpoints.state(
                        self.model, self.optimizer, self.scheduler, self.loader, step, self.device))
        finally:
            if collect_automatically:
                gc.enable()
            self.profiler.close()
            bar.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
            if metrics is not None:
                metrics.close()
        result.tokens_per_s = timing.tokens / timing.seconds if timing.seconds else 0.0
        self._finish(result)
        return result

    def _finish(self, result: TrainResult) -> None:
        """What a finished run leaves besides its metrics: the HF export, metrics.png, the summary line."""
        config = self.config
        if config.checkpoint.export_hf_at_end:
            from .export import export_trained

            export_trained(self.model, config, self.folder / "hf")  # every rank: the weights are gathered
        if self.rank != 0:
            return
        if config.metrics.plot and (self.folder / "metrics.jsonl").is_file():
            from .plot import write_plot

            write_plot(self.folder / "metrics.jsonl", self.folder / "metrics.png")
        self._summarize(result)

    def _resume(self) -> tuple[int, list[str]]:
        """Load the checkpoint to continue from (the newest, or checkpoint.load_step): the step it holds and
        the optimizer settings the command line changed (0 and [] for a fresh run)."""
        c = self.config.checkpoint
        committed = self.checkpoints.steps() if self.checkpoints is not None else []
        if c.load_step and c.load_step not in committed:
            raise ValueError(f"checkpoint.load_step={c.load_step} is not a committed checkpoint in "
                             f"{self.folder / 'checkpoints'} (committed: {committed or 'none'})")
        later = [s for s in committed if s > c.load_step] if c.load_step else []
        if later and c.interval:
            raise ValueError(f"checkpoint.load_step={c.load_step} with later checkpoints {later} in {self.folder}: "
                             "the resumed run would save over them; set checkpoint.interval 0, or start another "
                             "job.folder with checkpoint.initial_load")
        if not (committed and c.resume):
            return 0, []
        start = self.checkpoints.restore(self.model, self.optimizer, self.scheduler, self.loader, self.device,
                                         step=c.load_step or None)
        return start, self.optimizer_settings.reapply(self.optimizer, self.scheduler)

    def _read_back(self, pending: list[_PendingStep], result: TrainResult, timing: _Timing, *, first: int) -> dict:
        """Wait for the pending steps, check them (NonFiniteGuard), record their losses; returns the metrics
        record of the last one, whose throughput covers all of them (the wait included)."""
        began = time.perf_counter()
        self.guard.check()
        values = torch.stack([torch.stack([p.loss.float(), p.grad_norm.float(), p.mtp_loss.float()])
                              for p in pending]).tolist()
        pending[-1].seconds += time.perf_counter() - began
        tokens_per_step = self.config.training.batch_size * self.config.training.seq_len
        for p, (loss, _, _) in zip(pending, values):
            result.losses[p.step] = loss
            if p.step > first:  # the first step includes the warm-up
                timing.tokens, timing.seconds = timing.tokens + tokens_per_step, timing.seconds + p.seconds
        seconds = sum(p.seconds for p in pending) / len(pending)
        tokens_per_s = tokens_per_step / seconds
        world = dist.get_world_size() if dist.is_initialized() else 1
        mfu = self.flops_per_token * tokens_per_s / (self.peak * world) if self.peak else None
        last = pending[-1]
        record = {"step": last.step, "loss": values[-1][0], "tokens_per_s": tokens_per_s, "lr": last.lr,
                  "grad_norm": values[-1][1], "mfu": mfu, "memory_gib": memory_gib(self.device),
                  "memory_reserved_gib": memory_reserved_gib(self.device), "step_seconds": seconds}
        if self.model_cfg_mtp:  # beside the main loss, which stays comparable with runs without MTP
            record["mtp_loss"] = values[-1][2]
        if self.config.model.moe_routing != "learned":  # forced routing changes the workload: say so everywhere
            record["moe_routing"] = self.config.model.moe_routing
        return record

    def _announce(self, start: int, settings_changed: list[str]) -> None:
        c, d = self.config, self.degrees
        n_params = tm.count_params(self.model_cfg).total
        resumed = f", resuming after step {start}" if start else ""
        if settings_changed:
            resumed += f" with the command line's optimizer settings ({', '.join(settings_changed)})"
        model_name = c.model.hf_path or f"{c.model.family} {c.model.flavor}"
        data = ", ".join(f"{source} ({weight:g})" for source, weight in c.data.sources) or c.data.source
        print(f"titan-train: {model_name} ({n_params / 1e6:.1f}M parameters) on {self.device.type}, "
              f"pp={d.pp} dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} cp={d.cp} tp={d.tp} ep={d.ep}"
              f"{self._model_extras()}; "
              f"{c.training.steps} steps of {c.training.batch_size} x {c.training.seq_len} tokens from "
              f"{data}{resumed}; metrics in {self.folder / 'metrics.jsonl'}", flush=True)

    def _model_extras(self) -> str:
        """What the run trains or routes unlike a plain next-token run (MTP, forced-balance routing)."""
        m, extras = self.config.model, ""
        if self.model_cfg_mtp:
            extras += f", MTP {m.mtp_layers} (weight {self.config.training.mtp_loss_weight})"
        if m.moe_routing != "learned":
            extras += f", moe_routing={m.moe_routing}"
        return extras

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


@dataclass
class _PendingStep:
    """A step whose loss and gradient norm are still on the device."""

    step: int
    lr: float
    loss: torch.Tensor
    grad_norm: torch.Tensor
    mtp_loss: torch.Tensor
    seconds: float
    """Wall time of train_step (plus, for the last step before a read-back, the wait for the device)."""


@dataclass
class _Timing:
    tokens: int = 0
    seconds: float = 0.0
