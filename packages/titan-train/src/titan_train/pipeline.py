"""Pipeline parallelism with torch.distributed.pipelining: stages cut where the model's plan allows,
1F1B / interleaved 1F1B / zero-bubble schedules, the fused chunked loss on the last stage.

How a run is laid out:

- The model's blocks are split into `pp x stages_per_rank` stages of consecutive layers, cutting only at
  `model.parallel_plan.pipeline_cut_points`, as evenly as those allow. Looped schedules put stage s on
  pp rank s % pp; the V schedules (ZBVZeroBubble, DualPipeV) put stages r and 2 pp - 1 - r on rank r.
  With parallelism.pp_overlap_ep, DualPipeV's paired forward/backward overlaps one microbatch's expert
  all-to-alls with the other's compute (pipeline_overlap.py).
- Each rank keeps one *rank model*: the model built on meta with the other ranks' layers deleted
  (`layers` is a ModuleDict, so names do not change) and `tok_embeddings` / `norm`, `output` only where
  it holds the first / last stage. Everything that works on a model — tensor parallel, activation
  checkpointing, compile, materialization, the optimizer, gradient clipping and checkpoints (whose
  names therefore match a single-process run's) — works on it unchanged.
- A `PipelineStageModule` per stage holds that stage's share of the rank model's modules; torch's
  `PipelineStage` wraps it (and FSDP shards it as its own root, blocks first). Its forward takes tokens
  (first stage) or hidden states, plus `labels`, `positions` and `document_ids` as keyword arguments that
  the schedule splits into microbatches and hands to every stage.
- The last stage computes the fused output projection + cross-entropy of loss.py in its forward and
  returns the summed loss of its microbatch: FSDP's hooks and torch.compile then see the output weight
  used inside a forward, as in the non-pipelined CausalLMLoss. The schedule's `loss_fn` only scales that
  sum (1 / scored tokens of the global batch, times the FSDP degree FSDP divides by), so no
  `[tokens, vocab]` logits ever cross a stage boundary or exist whole.
- The gradient norm for clipping sums each pp rank's squared norm over the pp group; checkpoints go
  through `checkpoint_entries` (pipeline_checkpoint.py), so every rank saves the same entries.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelismConfig
from .grad_norm import clip_by_total_norm
from .loss import CausalLMLoss
from .model_setup import initial_state
from .parallelize import apply_fsdp

# Schedule name -> (class name in torch.distributed.pipelining, stage placement, stages per rank it takes).
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "GPipe": ("ScheduleGPipe", "loop", "one"),
    "1F1B": ("Schedule1F1B", "loop", "one"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop", "several"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop", "several"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v", "two"),
    "DualPipeV": ("ScheduleDualPipeV", "v", "two"),
}
# Schedules that split the backward into input and weight gradients: torch refuses compiled stages there.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Which layers each stage holds and which pp rank runs it."""

    stages: tuple[tuple[str, ...], ...]
    """stage index -> the names (keys of model.layers) of its blocks, in order."""
    ranks: tuple[int, ...]
    """stage index -> pp rank."""
    parameter_order: tuple[str, ...] = ()
    """The whole model's parameter names in model order (checkpoints list them so)."""

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.ranks) if r == pp_rank]


def resolve_stages_per_rank(schedule: str, stages_per_rank: int) -> int:
    """The stages each rank runs: the recipe's value, or (0) what the schedule needs (1, or 2 for the
    interleaved and V schedules)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pp_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    takes = SCHEDULES[schedule][2]
    if stages_per_rank < 0:
        raise ValueError(f"parallelism.pp_stages_per_rank must be >= 0 (0: the schedule's default), "
                         f"got {stages_per_rank}")
    if stages_per_rank == 0:
        return 1 if takes == "one" else 2
    if takes == "one" and stages_per_rank != 1:
        raise ValueError(f"parallelism.pp_schedule={schedule} runs one stage per rank, got "
                         f"pp_stages_per_rank={stages_per_rank} (use Interleaved1F1B or InterleavedZeroBubble)")
    if takes == "two" and stages_per_rank != 2:
        raise ValueError(f"parallelism.pp_schedule={schedule} runs exactly two stages per rank (a V), got "
                         f"pp_stages_per_rank={stages_per_rank}")
    return stages_per_rank


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    schedule: str
    stages_per_rank: int
    microbatches: int


def check_pipeline(config: ParallelismConfig, *, pp: int, rows: int, grad_accum_steps: int,
                   compiled: bool) -> PipelineSettings:
    """The recipe's pipeline fields checked against each other (before the model is built); `rows` is the
    number of sequences each data-parallel rank takes per step, which the microbatches split."""
    schedule = config.pp_schedule
    stages_per_rank = resolve_stages_per_rank(schedule, config.pp_stages_per_rank)
    if config.pp_microbatches < 0:
        raise ValueError(f"parallelism.pp_microbatches must be >= 0 (0: one per stage), got {config.pp_microbatches}")
    microbatches = config.pp_microbatches or pp * stages_per_rank
    check_microbatches(schedule=schedule, pp=pp, stages=pp * stages_per_rank, microbatches=microbatches, rows=rows)
    if grad_accum_steps != 1:
        raise ValueError(f"training.grad_accum_steps={grad_accum_steps} with parallelism.pp={pp}: the pipeline's "
                         "microbatches already accumulate gradients; set parallelism.pp_microbatches instead")
    if compiled and schedule in SPLIT_BACKWARD:
        raise ValueError(f"parallelism.pp_schedule={schedule} splits the backward into input and weight "
                         "gradients, which torch does not support for compiled stages; use compile.enabled=false "
                         "or the 1F1B / Interleaved1F1B schedules")
    if config.fsdp_impl != "fully_shard":
        raise ValueError(f"parallelism.pp > 1 shards stages with fully_shard; parallelism.fsdp_impl="
                         f"{config.fsdp_impl} is not supported with pipeline parallelism yet")
    return PipelineSettings(schedule=schedule, stages_per_rank=stages_per_rank, microbatches=microbatches)


def check_microbatches(*, schedule: str, pp: int, stages: int, microbatches: int, rows: int) -> None:
    """`rows`: sequences per step on each data-parallel rank, which the microbatches split."""
    if rows % microbatches:
        raise ValueError(f"parallelism.pp_microbatches={microbatches} must divide the sequences each data-parallel "
                         f"rank takes per step (training.batch_size / dp = {rows})")
    if schedule != "GPipe" and microbatches < pp:
        raise ValueError(f"parallelism.pp_schedule={schedule} needs at least pp={pp} microbatches to fill the "
                         f"pipeline, got pp_microbatches={microbatches}")
    if SCHEDULES[schedule][2] != "one" and microbatches % pp:
        raise ValueError(f"parallelism.pp_schedule={schedule} needs pp_microbatches to be a multiple of pp={pp}, "
                         f"got {microbatches}")
    if schedule == "DualPipeV" and microbatches < stages:
        raise ValueError(f"parallelism.pp_schedule=DualPipeV needs at least one microbatch per stage ({stages}), "
                         f"got pp_microbatches={microbatches}")


def plan_layout(model: nn.Module, *, pp: int, schedule: str, stages_per_rank: int) -> PipelineLayout:
    """Split `model.layers` into pp * stages_per_rank stages at the plan's cut points, as evenly as they allow."""
    names = list(model.layers.keys())
    num_stages = pp * stages_per_rank
    cuts = set(model.parallel_plan.pipeline_cut_points)
    if num_stages > len(names):
        raise ValueError(f"pipeline parallelism needs at least one block per stage: pp={pp} x "
                         f"{stages_per_rank} stages per rank = {num_stages} stages, but the model has {len(names)} "
                         "layers")
    starts = [0]
    for stage in range(1, num_stages):
        target = round(stage * len(names) / num_stages)
        # A later stage must still find one block each after this cut.
        allowed = [i for i in range(starts[-1] + 1, len(names) - (num_stages - stage) + 1)
                   if f"layers.{names[i]}" in cuts]
        if not allowed:
            raise ValueError(f"the model's parallel plan allows no pipeline cut for stage {stage} of {num_stages} "
                             f"(cut points: {sorted(cuts) or 'none'})")
        starts.append(min(allowed, key=lambda i: (abs(i - target), i)))
    bounds = [*starts, len(names)]
    stages = tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:]))
    if SCHEDULES[schedule][1] == "v":
        ranks = tuple(s if s < pp else 2 * pp - 1 - s for s in range(num_stages))
    else:
        ranks = tuple(s % pp for s in range(num_stages))
    return PipelineLayout(stages=stages, ranks=ranks, parameter_order=tuple(n for n, _ in model.named_parameters()))


def keep_rank_part(model: nn.Module, layout: PipelineLayout, pp_rank: int) -> None:
    """Delete (on meta, before anything is allocated) what the stages of `pp_rank` do not hold."""
    if getattr(model, "tie_embeddings", False):
        raise ValueError("pipeline parallelism with tied embeddings is not supported: the embedding (first stage) "
                         "and the output projection (last stage) would share one weight across stages; use an "
                         "untied flavor or pp=1")
    mine = layout.stages_of(pp_rank)
    keep = {name for s in mine for name in layout.stages[s]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if 0 not in mine:
        model.tok_embeddings = None
    if len(layout.stages) - 1 not in mine:
        model.norm = None
        model.output = None
        for extra in ("mtp",):  # modules only the last stage uses (DeepSeek-V3's multi-token prediction)
            if getattr(model, extra, None) is not None:
                setattr(model, extra, None)


class PipelineStageModule(nn.Module):
    """One stage: embeddings (first stage), a run of blocks, and on the last stage the final norm and the
    fused output projection + cross-entropy. Its modules are the rank model's own (shared, not copied).

    The stage is a titan-models Transformer of its own over those modules (`tok_embeddings`, `norm` and
    `output` None where the stage lacks them), so it runs the model's own forward (`hidden_states`), and
    its last stage the trainer's own loss (a CausalLMLoss over that Transformer, tensor parallel included).

    forward(x, *, labels, positions, document_ids=None): x is tokens [b, s] on the first stage, else the
    previous stage's hidden states [b, s, d] ([b, s / tp, d] under sequence parallel); returns hidden
    states, or on the last stage the summed loss of this microbatch's tokens (a 0-dim fp32 tensor).
    """

    def __init__(self, model: nn.Module, layer_names: tuple[str, ...], *, first: bool, last: bool,
                 loss: CausalLMLoss, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        stage = model.pipeline_stage(layer_names, first=first, last=last)
        # Multi-token prediction: the MTP module on the last stage; the embeddings of its input tokens
        # come from the first stage (which holds the shared table) and travel beside the hidden states.
        self.mtp = bool(getattr(model.config, "mtp", False))  # model.mtp is gone on the other stages' ranks
        if last and self.mtp:
            stage.mtp = model.mtp
        self.transformer, self.first = stage, first
        self.loss = loss.with_model(stage) if last else None
        self.context_factory, self.autocast_dtype = loss.context_factory, autocast_dtype

    def forward(self, x: torch.Tensor, mtp_embeddings: torch.Tensor | None = None, *, labels: torch.Tensor,
                positions: torch.Tensor, document_ids: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None):
        autocast = (torch.autocast(x.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                    else contextlib.nullcontext())
        with autocast:
            if self.first and self.mtp:
                mtp_embeddings = self.transformer.tok_embeddings(mtp_tokens)
            if self.loss is not None:  # (main, MTP) summed losses [2]
                sums = self.loss(x, labels, document_ids, positions, mtp_embeddings=mtp_embeddings,
                                 mtp_labels=mtp_labels)
                return sums if self.mtp else torch.stack([sums, torch.zeros_like(sums)])
            context = self.context_factory(document_ids) if self.context_factory is not None else None
            hidden = self.transformer.hidden_states(x, positions=positions, context=context)
            # a view, so the passed-on embeddings are an output of this stage's graph, not its input leaf
            return (hidden, mtp_embeddings.view_as(mtp_embeddings)) if self.mtp else hidden


class Pipeline:
    """This rank's stages and the schedule that runs them; `step` is one optimizer step's forward/backward."""

    def __init__(self, model: nn.Module, layout: PipelineLayout, *, schedule: str, loss: CausalLMLoss,
                 microbatches: int, mesh: DeviceMesh, device: torch.device, autocast_dtype: torch.dtype | None = None,
                 overlap_ep: bool = False):
        """loss: the rank model's CausalLMLoss, whose settings the last stage's loss takes; overlap_ep: DualPipeV's
        paired forward/backward run as alternating turns around the expert all-to-alls (pipeline_overlap.py)."""
        import torch.distributed.pipelining as pipelining

        self.group = mesh["pp"].get_group()
        self.pp_rank = mesh.get_local_rank("pp")
        self.slice_ranks = mesh.mesh[self.pp_rank].flatten().tolist()  # the ranks that hold the same stages
        self.layout = layout
        if (SCHEDULES[schedule][1] == "v" and dist.get_backend(self.group) == "gloo"
                and not hasattr(pipelining.PipelineStage, "_is_same_rank")):
            # The V's turn puts two neighbouring stages on one rank; older pipelining warms their link up
            # with a send to itself, which NCCL does but gloo cannot.
            raise ValueError(f"parallelism.pp_schedule={schedule} needs NCCL or a newer torch than {torch.__version__} "
                             "on gloo (CPU); use 1F1B, Interleaved1F1B or InterleavedZeroBubble there")
        self.num_stages = num_stages = len(layout.stages)
        self.stage_indices = layout.stages_of(self.pp_rank)
        self.modules = [PipelineStageModule(model, layout.stages[s], first=s == 0, last=s == num_stages - 1,
                                            loss=loss, autocast_dtype=autocast_dtype)
                        for s in self.stage_indices]
        self.schedule_name, self.microbatches, self.device = schedule, microbatches, device
        self.overlap_ep = overlap_ep
        self.has_first, self.has_last = 0 in self.stage_indices, num_stages - 1 in self.stage_indices
        self._scale, self._mtp_weight = 1.0, 0.0
        self.fsdp = False  # set by apply_fsdp
        self._pipelining = pipelining
        self.schedule = None  # built by finish(), after FSDP has wrapped the stage modules

    def apply_fsdp(self, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None, reshard_after_forward: bool) -> None:
        """fully_shard each stage's blocks, then the stage module as its own root (embeddings, norm, output)."""
        self.fsdp = True
        for module in self.modules:
            apply_fsdp(module, list(module.transformer.layers.values()), dp_mesh, param_dtype=param_dtype,
                       reshard_after_forward=reshard_after_forward)

    def finish(self) -> None:
        """Wrap the (materialized, possibly sharded) stage modules in PipelineStages and build the schedule."""
        p = self._pipelining
        # The last stage runs its whole backward with the input gradients (and nothing at the weight step)
        # where torch's split backward goes wrong there: under FSDP (the stage root's norm and output
        # gradients come out wrong, seen on torch 2.14) or where it cannot cut the graph at the fused
        # loss, a custom autograd Function (torch 2.11). Its bubble is then that of interleaved 1F1B.
        whole_last = self.schedule_name in SPLIT_BACKWARD and (
            self.fsdp or not split_backward_handles_custom_functions())
        stages = [p.PipelineStage(module, index, self.num_stages, self.device, group=self.group,
                                  dw_builder=_no_weight_step if whole_last and index == self.num_stages - 1 else None)
                  for module, index in zip(self.modules, self.stage_indices)]
        schedule_cls = getattr(p, SCHEDULES[self.schedule_name][0])
        # scale_grads=False: the loss is already normalised by the global count of scored tokens.
        if len(stages) == 1 and SCHEDULES[self.schedule_name][2] == "one":
            self.schedule = schedule_cls(stages[0], self.microbatches, loss_fn=self._loss_fn, scale_grads=False)
        else:
            self.schedule = schedule_cls(stages, self.microbatches, loss_fn=self._loss_fn, scale_grads=False)
        if self.overlap_ep:  # check_pipeline_overlap allowed it for DualPipeV only
            from torch.distributed.pipelining.schedules import OVERLAP_F_B

            from .pipeline_overlap import OverlappedForwardBackward

            self.schedule.register_custom_function(OVERLAP_F_B, OverlappedForwardBackward(self.schedule))

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the last stage's forward already returned this microbatch's summed (main, MTP)
        losses [2]; the objective is main + mtp_weight * MTP, scaled. (torch may also call it on a warm-up
        output to infer gradient shapes, so it records nothing.)"""
        objective = output[0] if self._mtp_weight == 0 else output[0] + self._mtp_weight * output[1]
        return objective * self._scale

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
             document_ids: torch.Tensor | None, *, scale: float, mtp=None, mtp_weight: float = 0.0) -> torch.Tensor:
        """Forward and backward over this data-parallel rank's rows ([rows, s] each), `microbatches` at a
        time; `mtp`: the rows' multi_token.MTPBatch (model.mtp_layers > 0). Returns the summed (main, MTP)
        losses [2] of those rows on the rank holding the last stage, zeros elsewhere."""
        self._scale, self._mtp_weight = scale, mtp_weight
        kwargs = {"labels": labels, "positions": positions}
        if document_ids is not None:
            kwargs["document_ids"] = document_ids
        if mtp is not None:
            kwargs |= {"mtp_tokens": mtp.tokens, "mtp_labels": mtp.labels}
        args = (tokens,) if self.has_first else ()
        # The last stage's outputs, [2] per microbatch, come back concatenated: [2 * microbatches].
        outputs = self.schedule.step(*args, target=labels, return_outputs=True, **kwargs)
        if not self.has_last or outputs is None:
            return torch.zeros(2, device=self.device, dtype=torch.float32)
        return outputs.detach().float().view(-1, 2).sum(0)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                 document_ids: torch.Tensor | None) -> torch.Tensor:
        """Forward only over this data-parallel rank's rows: their summed loss on the rank holding the last
        stage, 0 elsewhere (as `step`, without the backward)."""
        self._scale = 1.0
        kwargs = {"labels": labels, "positions": positions}
        if document_ids is not None:
            kwargs["document_ids"] = document_ids
        args = (tokens,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        with self._backward_actions_skipped():
            if hasattr(self.schedule, "eval"):  # outputs are 0-dim losses: not merged (return_outputs reaches step)
                self.schedule.eval(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
            else:  # torch without Schedule.eval: the same switch it makes
                has_backward, self.schedule._has_backward = self.schedule._has_backward, False
                try:
                    self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
                finally:
                    self.schedule._has_backward = has_backward
        if not losses:
            return torch.zeros((), device=self.device, dtype=torch.float32)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    @contextlib.contextmanager
    def _backward_actions_skipped(self):
        """V schedules while evaluating: torch's runtime still runs their backward actions, which at the V's
        turn hand a gradient to the rank's other stage and assert there is a backward. Here they only drop
        their (empty) receives, and a paired forward/backward runs its forward alone."""
        if SCHEDULES[self.schedule_name][1] != "v":
            yield
            return
        from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD, OVERLAP_F_B

        from .pipeline_overlap import OverlappedForwardBackward

        functions = self.schedule._comp_type_to_function_map  # register_custom_function's table (it cannot remove)
        saved = dict(functions)
        functions.update(dict.fromkeys((FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), _drop_backward_receive))
        functions.setdefault(OVERLAP_F_B, OverlappedForwardBackward(self.schedule))
        try:
            yield
        finally:
            functions.clear()
            functions.update(saved)

    def checkpoint_entries(self, state: dict) -> dict:
        """The run's checkpoint state with the model and optimizer entries presenting every stage (see
        pipeline_checkpoint.py), so the ranks' states fit together and load into any layout."""
        from .pipeline_checkpoint import StageEntries

        for key in [key for key in ("model", "optimizer") if key in state]:
            state[key] = StageEntries(state[key], pp_group=self.group, slice_ranks=self.slice_ranks,
                                      model_order=list(self.layout.parameter_order))
        return state

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float, *, read_norm: bool = True) -> torch.Tensor:
        """Clip by the norm over every stage's gradients: each pp rank's norm over its own stages, reduced
        over the pp group (squares summed). Returns that global norm (before clipping)."""
        return clip_by_total_norm(params, max_norm, sum_over=self.group, read_norm=read_norm)


@functools.cache
def split_backward_handles_custom_functions() -> bool:
    """Whether this torch's zero-bubble split (input gradients now, weight gradients later) works when a
    weight meets the activations first in a custom autograd Function, as the output weight does in the fused
    loss. torch 2.11's fails there ("Attribute '_input_metadata' is invalid"); later ones do not."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return (x * w).sum()

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, grad * x

    x, w = torch.ones(2, requires_grad=True), nn.Parameter(torch.full((2,), 2.0))
    try:
        _, groups = stage_backward_input((Product.apply(x * 3, w),), None, [x], iter([w]))
        stage_backward_weight(iter([w]), groups)
    except RuntimeError:
        return False
    return bool(torch.equal(w.grad, torch.full((2,), 3.0)))


def _drop_backward_receive(action, ctx) -> None:
    """A backward action while evaluating: nothing to compute; its receive (empty without a backward) is dropped."""
    ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)


def _no_weight_step():
    """A PipelineStage dw_builder: the weight gradients were computed with the input gradients already."""
    return lambda: None


def materialize_rank_part(model: nn.Module, model_cfg, *, device: torch.device, seed: int, hf_path: str = "",
                          adapters=None) -> None:
    """model_setup.materialize for a rank model that holds only some layers: rank 0 builds the whole initial
    state and broadcasts every tensor; each rank keeps those of its own stages (a non-strict load, since
    rank 0's full state names layers it does not hold)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    full = initial_state(model_cfg, seed=seed, hf_path=hf_path, adapters=adapters) if dist.get_rank() == 0 else {}
    model.init_buffers()  # buffers (RoPE frequencies) are recomputed, not broadcast
    expected = set(model.state_dict())
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    if dist.get_rank() == 0:
        assert expected <= set(full), f"initial state lacks {sorted(expected - set(full))[:5]}"
