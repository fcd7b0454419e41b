"""On a GPU: graph mode in bf16 (autocast) is bit for bit eager over 20 steps, for the dense
and MoE debug models; remat under a budget keeps the measured peak within it. Eager's own repeatability
is the control (a run repeated must give the same bits, or no comparison with it means anything)."""
from __future__ import annotations

import pytest
import torch

from titan_train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

COMMON = {"job.device": "cuda", "training.steps": "20", "training.seq_len": "256", "training.batch_size": "8",
          "model.num_layers": "4", "training.mixed_precision": "bf16",
          "training.fused_kernels": "false"}  # graph mode cannot trace the raw Triton launches
MOE = {"model.family": "qwen3", "model.flavor": "debug_moe"}


def run(jobs, folder, **overrides):
    trainer = Trainer(jobs.tiny(folder, **COMMON, **overrides), torch.device("cuda"))
    losses = trainer.run().losses
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_graph_mode_bf16_bitwise_equal_to_eager(tmp_path, jobs, model):
    eager = run(jobs, tmp_path / "eager", **model)
    again = run(jobs, tmp_path / "again", **model)
    assert again[0] == eager[0], "eager bf16 is not repeatable on this GPU: the bitwise comparison needs it"
    passes = "remove_detach,eliminate_dead_code,sink_allocations"
    graph = run(jobs, tmp_path / "graph", **model, **{"compile.mode": "graph", "compile.graph_passes": passes})
    assert graph[0] == eager[0]
    assert [n for n in eager[1] if not torch.equal(eager[1][n], graph[1][n])] == []


def test_remat_budget_holds_measured_peak(tmp_path, jobs):
    budget = 0.5
    torch.cuda.reset_peak_memory_stats()
    run(jobs, tmp_path, **{"activation_checkpoint.mode": "remat",
                           "activation_checkpoint.memory_budget_gib": str(budget)})
    assert torch.cuda.max_memory_allocated() <= budget * (1 << 30)
