"""compile.mode=graph with multi-token prediction (DeepSeek-V3 debug, one MTP module, one process): the captured
step differentiates main + weight * MTP like eager autograd, so it gives eager's main loss, MTP loss and
gradient norm bit for bit at every step, and eager's final weights (MTP module and expert biases included),
as test_graph_mode.py promises without MTP. A control shows the MTP term is in the captured objective:
training.mtp_loss_weight 0 and 0.3 give the same step-1 losses (same weights) but different gradients.

Time: about 12 s of CPU (four short runs of a 2-layer model); 28 s wall on the loaded shared 2-core machine.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_train.trainer import Trainer

MTP = {"parallelism.ep": "1", "model.mtp_layers": "1", "training.mtp_loss_weight": "0.3"}
GRAPH = {"compile.mode": "graph", "compile.graph_passes": "remove_detach,eliminate_dead_code,sink_allocations"}


def run_job(jobs, folder: Path, **overrides: str):
    """(per-step (loss, mtp_loss, grad_norm), initial and final parameters and buffers, trainer)."""
    trainer = Trainer(jobs.tiny(folder, "deepseek_v3_debug_ep", **{**MTP, **overrides}), torch.device("cpu"))

    def state():
        return {n: t.detach().clone() for n, t in [*trainer.model.named_parameters(), *trainer.model.named_buffers()]}

    initial = state()
    trainer.run()
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: (r["loss"], r["mtp_loss"], r["grad_norm"]) for r in records}
    return curve, initial, state(), trainer


def test_graph_mode_with_mtp_bitwise_equal_to_eager(tmp_path, jobs):
    job = {"training.steps": "10", "training.grad_accum_steps": "2"}  # two microbatches: the sums add up too
    eager_curve, initial, eager_final, _ = run_job(jobs, tmp_path / "eager", **job)
    graph_curve, _, graph_final, trainer = run_job(jobs, tmp_path / "graph", **job, **GRAPH)

    assert graph_curve == eager_curve  # float equality of loss, mtp_loss and grad_norm at each of the 10 steps
    assert eager_final.keys() == graph_final.keys()
    different = [n for n in eager_final if not torch.equal(eager_final[n], graph_final[n])]
    assert not different, f"final weights differ: {different}"
    assert len(trainer.graph_step.graphs) == 1  # both microbatches, all 10 steps: one captured graph
    assert trainer.graph_step.opaque_experts == 2  # the MoE layer's experts and the MTP block's
    # it trained, MTP module included (its projection moved; its routing bias was updated)
    assert eager_curve[10][0] < eager_curve[1][0] - 0.3 and eager_curve[10][1] < eager_curve[1][1] - 0.3
    for name in ("mtp.eh_proj.weight", "mtp.layer.moe.expert_bias"):
        assert not torch.equal(graph_final[name], initial[name]), name


def test_mtp_weight_enters_the_captured_objective(tmp_path, jobs):
    """Control: with weight 0 the captured step's gradients are the main loss's alone."""
    job = {"training.steps": "2", **GRAPH}
    without, *_ = run_job(jobs, tmp_path / "zero", **job, **{"training.mtp_loss_weight": "0"})
    weighted, *_ = run_job(jobs, tmp_path / "weighted", **job)
    assert without[1][:2] == weighted[1][:2]  # the same initial weights: the same losses, MTP loss logged in both
    assert without[1][2] != weighted[1][2]  # the MTP term's gradient is in the norm
    assert abs(without[1][2] - weighted[1][2]) > 1e-3 * weighted[1][2]
    assert without[2][0] != weighted[2][0]  # and in the update


def test_graph_mode_refuses_image_text_data(tmp_path, jobs):
    with pytest.raises(ValueError, match="compile.mode=graph captures text batches only"):
        Trainer(jobs.tiny(tmp_path, "qwen3_vl_debug_shapes", **{"compile.mode": "graph"}), torch.device("cpu"))
