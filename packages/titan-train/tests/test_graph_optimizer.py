"""compile.graph_optimizer: the AdamW update as a second captured graph gives eager's losses and final
weights bit for bit (foreach, for-loop and fused AdamW; dense, MoE; FSDP on 2 gloo ranks), one graph for
every step, and configurations it cannot capture are refused by name."""
from __future__ import annotations

import pytest
import torch
from test_graph_mode import MOE, _on_two_ranks, assert_bitwise, run_job

from titan_train.graph import op_counts
from titan_train.trainer import Trainer

GRAPH_OPTIMIZER = {"compile.mode": "graph", "compile.graph_optimizer": "true"}


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_twenty_steps_bitwise_equal_to_eager(tmp_path, jobs, model):
    steps = {"training.steps": "20", **model}
    eager = run_job(jobs, tmp_path / "eager", **steps)
    losses, weights, trainer = run_job(jobs, tmp_path / "graph", **steps, **GRAPH_OPTIMIZER)
    assert_bitwise(eager[:2], (losses, weights))
    graphs = trainer.graph_optimizer.graphs
    assert len(graphs) == 1  # traced at step 1, replayed for the 19 others while the lr changed
    assert eager[0][20] < eager[0][1] - 0.5  # it trained
    counts = op_counts(next(iter(graphs.values())))
    n = sum(1 for p in trainer.model.parameters())
    assert counts["aten.lerp_.Scalar"] == n  # every parameter's update is in the graph, none eager
    assert counts["aten._foreach_addcdiv_.Tensor"] == len(trainer.optimizer.param_groups)


@pytest.mark.parametrize("implementation", ["for-loop", "fused"])
def test_other_adamw_kernels_bitwise(tmp_path, jobs, implementation):
    """for-loop (torch's single-tensor path) and fused (torch's CPU fused kernel, the tensor-lr overload)."""
    run = {"training.steps": "8", "optimizer.implementation": implementation}
    eager = run_job(jobs, tmp_path / "eager", **run)
    losses, weights, trainer = run_job(jobs, tmp_path / "graph", **run, **GRAPH_OPTIMIZER)
    assert_bitwise(eager[:2], (losses, weights))
    counts = op_counts(next(iter(trainer.graph_optimizer.graphs.values())))
    assert ("aten._fused_adamw_.tensor_lr" in counts) == (implementation == "fused")


def test_a_baked_learning_rate_would_be_caught(tmp_path, jobs):
    """Control: the same graph with step 1's scalars frozen into it drifts from eager (the lr schedule
    warms up and decays over these steps), so the bitwise test above can see a graph that ignores them."""
    from titan_train.graph import optimizer_graph

    run = {"training.steps": "6"}
    eager = run_job(jobs, tmp_path / "eager", **run)
    frozen: dict = {}
    original = optimizer_graph.GraphAdamW._group_inputs

    def first_scalars_forever(self, group):
        inputs = original(self, group)
        key = id(group)
        frozen.setdefault(key, inputs["scalars"].clone())
        inputs["scalars"].copy_(frozen[key])
        return inputs

    optimizer_graph.GraphAdamW._group_inputs = first_scalars_forever
    try:
        losses, weights, _ = run_job(jobs, tmp_path / "frozen", **run, **GRAPH_OPTIMIZER)
    finally:
        optimizer_graph.GraphAdamW._group_inputs = original
    assert losses[1] == eager[0][1] and losses[2] == eager[0][2]  # step 1's update is the same
    assert losses[6] != eager[0][6]


def test_dump_writes_the_optimizer_graph(tmp_path, jobs):
    run_job(jobs, tmp_path, **{"training.steps": "2", "compile.dump_graph": "true", **GRAPH_OPTIMIZER})
    table = (tmp_path / "graph" / "optimizer0_ops.txt").read_text()
    assert "aten._foreach_addcdiv_.Tensor" in table and "aten.lerp_.Scalar" in table


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, jobs) -> dict[tuple[str, str], tuple[dict[int, float], dict[str, torch.Tensor]]]:
    """(model, run) -> (losses, final weights) of dense and MoE, eager and graph: 10 steps on the same 2 gloo
    ranks, the four runs in one spawn (not one per model)."""
    root = tmp_path_factory.mktemp("fsdp")
    configs = {}
    for name, model in (("dense", {}), ("moe", MOE)):
        steps = {"training.steps": "10", **model}
        configs[name, "eager"] = jobs.tiny(root / f"{name}_eager", **steps)
        configs[name, "graph"] = jobs.tiny(root / f"{name}_graph", **steps, **GRAPH_OPTIMIZER)
    return dict(zip(configs, _on_two_ranks(*configs.values())))


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_fsdp_two_ranks_bitwise_equal_to_eager_fsdp(fsdp_runs, model):
    """The sharded update is elementwise on each rank's shards: captured on the local tensors (MoE: the
    stacked experts' dim-0 shards and the routers' group too)."""
    assert_bitwise(fsdp_runs[model, "eager"], fsdp_runs[model, "graph"])


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer.name": "muon"}, "optimizer.name=muon"),
    ({"training.mixed_precision": "bf16_params"}, "bf16_params"),
])
def test_uncapturable_optimizers_are_refused(tmp_path, jobs, overrides, message):
    with pytest.raises(ValueError, match=message):
        Trainer(jobs.tiny(tmp_path, **overrides, **GRAPH_OPTIMIZER), torch.device("cpu"))


def test_graph_optimizer_needs_graph_mode(tmp_path, jobs):
    with pytest.raises(ValueError, match="needs compile.mode=graph"):
        Trainer(jobs.tiny(tmp_path, **{"compile.graph_optimizer": "true"}), torch.device("cpu"))


def test_foreach_on_cuda_is_refused_without_a_gpu():
    """The CUDA check runs on the optimizer's settings alone (no CUDA tensor needed)."""
    from titan_train.graph.optimizer_graph import check_graph_optimizer

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True)
    with pytest.raises(ValueError, match="fused AdamW only"):
        check_graph_optimizer(optimizer, torch.device("cuda"))
    check_graph_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True), torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused CUDA AdamW needs a GPU")
def test_fused_cuda_adamw_bitwise(tmp_path, jobs):
    """On the GPU (bf16 autocast, fused AdamW, the CUDA defaults): the graph step with the eager update
    against the graph step with the captured one."""
    run = {"job.device": "cuda", "training.fused_kernels": "false", "training.steps": "20", "compile.mode": "graph"}
    results = []
    for name, extra in (("eager_update", {}), ("graph_update", {"compile.graph_optimizer": "true"})):
        trainer = Trainer(jobs.tiny(tmp_path / name, **run, **extra), torch.device("cuda"))
        losses = trainer.run().losses
        results.append((losses, {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}))
    assert_bitwise(*results)
    counts = op_counts(next(iter(trainer.graph_optimizer.graphs.values())))
    assert counts["aten._fused_adamw_.tensor_lr"] == len(trainer.optimizer.param_groups)  # one call per group


def test_resume_continues_the_captured_update(tmp_path, jobs):
    """The state stays in the torch optimizer: a run checkpointed at step 3 and resumed (a new graph traced
    on the loaded state) ends on the uninterrupted eager run's weights."""
    constant = {"lr_schedule.kind": "constant"}  # the schedule does not depend on training.steps
    saved = {**constant, **GRAPH_OPTIMIZER, "checkpoint.interval": "3", "checkpoint.async_save": "false"}
    whole_losses, whole_weights, _ = run_job(jobs, tmp_path / "whole", **constant, **{"training.steps": "6"})
    run_job(jobs, tmp_path / "resumed", **saved, **{"training.steps": "3"})
    losses, weights, trainer = run_job(jobs, tmp_path / "resumed", **saved,
                                       **{"training.steps": "6", "checkpoint.resume": "true"})
    assert sorted(losses) == [4, 5, 6] and len(trainer.graph_optimizer.graphs) == 1
    assert_bitwise(({s: whole_losses[s] for s in losses}, whole_weights), (losses, weights))
