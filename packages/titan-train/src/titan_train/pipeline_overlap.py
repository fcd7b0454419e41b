"""DualPipeV with the expert all-to-alls of one microbatch overlapped by another's compute
(`parallelism.pp_overlap_ep`).

torch's ScheduleDualPipeV pairs, in its steady state, the forward (F) of one microbatch on one of a rank's
two stages with the full backward (B) of an earlier microbatch on the other (an OVERLAP_F_B action), but
runs the two one after the other. Here that action runs the pair as two turns:

- F runs on a helper thread and B on the schedule's thread, never both at once: one holds the turn
  (`dist_moe.TakingTurns`).
- Inside `dist_moe.overlap_all_to_all`, each expert-parallel all-to-all (a MoE layer's forward makes three:
  the split sizes, the token rows out, the expert outputs back; its backward two: the reverse exchanges)
  is issued asynchronously, and the thread that issued it hands the turn over before waiting on it.
- So while one of F's exchanges is in flight, B computes its backward up to its own next exchange (an
  experts' backward, or the shared experts, router, attention and dense layers between two MoE layers);
  while that one is in flight, F computes up to its next (its experts, or the attention and gate of its
  next MoE layer); each waits on an exchange only after the other's compute has run behind it. On gloo
  the rows move on gloo's threads; on NCCL on its stream while the compute stream takes the other
  microbatch's kernels.
- When one of the two has finished, the other runs alone (its exchanges then block as usual).

The hand-overs happen at points fixed by the model's structure, identical on every rank of a pipeline
slice, so every process group sees its collectives in the same order on all its ranks, and each turn's
arithmetic is the sequential one: gradients are bitwise those of the plain DualPipeV schedule.

The action's two halves repeat what torch's runtime does for a FORWARD and a FULL_BACKWARD action
(`_PipelineScheduleRuntime._step_microbatches`), through the same stage methods; only their interleaving
differs. Warm-up and cool-down actions, the unpaired F and B, run as before.
"""
from __future__ import annotations

import torch

import dist_moe

from .config import ParallelismConfig


def check_pipeline_overlap(config: ParallelismConfig) -> None:
    """parallelism.pp_overlap_ep against the other degrees and this torch (before the model is built)."""
    if not config.pp_overlap_ep:
        return
    if config.pp < 2 or config.pp_schedule != "DualPipeV":
        raise ValueError(f"parallelism.pp_overlap_ep overlaps the expert all-to-alls inside DualPipeV's paired "
                         f"forward/backward: it needs parallelism.pp_schedule=DualPipeV and pp >= 2, got "
                         f"pp_schedule={config.pp_schedule} with pp={config.pp}")
    if config.ep < 2:
        raise ValueError(f"parallelism.pp_overlap_ep overlaps expert-parallel all-to-alls: it needs "
                         f"parallelism.ep >= 2, got ep={config.ep}")
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    if not hasattr(ScheduleDualPipeV, "register_custom_function"):
        raise ValueError(f"parallelism.pp_overlap_ep needs torch's pipelining runtime with custom actions "
                         f"(register_custom_function), which torch {torch.__version__} lacks")


class OverlappedForwardBackward:
    """The OVERLAP_F_B action of torch's pipelining runtime (registered with register_custom_function): its
    FORWARD and FULL_BACKWARD sub-actions as the two turns of a dist_moe.TakingTurns. Evaluation (no
    backward) runs the forward alone."""

    def __init__(self, schedule):
        self.stages = {stage.stage_index: stage for stage in schedule._stages}

    def __call__(self, action, ctx) -> None:
        from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD

        schedule = ctx.schedule_ref
        forward, backward = action.sub_actions
        assert (forward.computation_type, backward.computation_type) == (FORWARD, FULL_BACKWARD), action
        assert forward.stage_index != backward.stage_index, action
        if not schedule._has_backward:  # evaluation: the backward has nothing to do but drop its (empty) receive
            self._forward(schedule, forward, ctx)
            schedule.bwd_recv_ops.pop((backward.stage_index, backward.microbatch_index), None)
            return
        dist_moe.TakingTurns().run(lambda: self._forward(schedule, forward, ctx),
                                   lambda: self._backward(schedule, backward))

    def _forward(self, schedule, action, ctx) -> None:
        """torch's FORWARD action. The outputs are kept exactly when the step has a backward: Pipeline.step
        asks for them (return_outputs=True), Pipeline.evaluate does not."""
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        stage, mb = self.stages[action.stage_index], action.microbatch_index
        schedule._assert_unsharded(stage)
        if not stage.is_first and action.stage_index - 1 not in self.stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((action.stage_index, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb],
                                         save_forward_output=schedule._has_backward)
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if action.stage_index + 1 in self.stages:  # the V's turn: the next stage is on this rank
            self.stages[action.stage_index + 1].set_local_fwd_input(output, mb)

    def _backward(self, schedule, action) -> None:
        """torch's FULL_BACKWARD action."""
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        stage, mb = self.stages[action.stage_index], action.microbatch_index
        schedule._assert_unsharded(stage)
        if not stage.is_last and action.stage_index + 1 not in self.stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((action.stage_index, mb)))
        loss = schedule._maybe_get_loss(stage, mb)
        schedule.backward_counter[action.stage_index] += 1
        last_backward = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
        if action.stage_index - 1 in self.stages:
            self.stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
