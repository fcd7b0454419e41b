"""compile.mode=graph: the captured step gives bit for bit eager's losses and final weights (dense, MoE,
FSDP on 2 gloo ranks, gradient accumulation), dumps an inspectable graph, and runs registered passes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from titan_train.graph import graph_passes, op_counts
from titan_train.trainer import Trainer

MOE = {"model.family": "qwen3", "model.flavor": "debug_moe"}
ALL_PASSES = {"compile.graph_passes": "remove_detach,eliminate_dead_code,sink_allocations"}


def run_job(jobs, folder: Path, **overrides: str) -> tuple[dict[int, float], dict[str, torch.Tensor], Trainer]:
    trainer = Trainer(jobs.tiny(folder, **overrides), torch.device("cpu"))
    losses = trainer.run().losses
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def assert_bitwise(eager, graph):
    (eager_losses, eager_weights), (graph_losses, graph_weights) = eager, graph
    assert graph_losses == eager_losses  # float equality: bit for bit
    assert eager_weights.keys() == graph_weights.keys()
    different = [n for n in eager_weights if not torch.equal(eager_weights[n], graph_weights[n])]
    assert not different, f"final weights differ: {different}"


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_twenty_steps_bitwise_equal_to_eager(tmp_path, jobs, model):
    steps = {"training.steps": "20", **model}
    eager = run_job(jobs, tmp_path / "eager", **steps)
    graph_losses, graph_weights, trainer = run_job(jobs, tmp_path / "graph", **steps, **ALL_PASSES,
                                                   **{"compile.mode": "graph"})
    assert_bitwise(eager[:2], (graph_losses, graph_weights))
    assert len(trainer.graph_step.graphs) == 1  # traced once, replayed for the other 19 steps
    assert eager[0][20] < eager[0][1] - 0.5  # it trained: the comparison is not of two untouched models
    if model:
        assert trainer.graph_step.opaque_experts == 2  # both MoE layers' loops are opaque nodes
        counts = op_counts(next(iter(trainer.graph_step.graphs.values())))
        assert counts["titan_graph.experts_loop.default"] == 2
        assert counts["titan_graph.experts_loop_backward.default"] == 2


def test_gradient_accumulation_bitwise(tmp_path, jobs):
    accum = {"training.steps": "3", "training.grad_accum_steps": "2"}
    eager = run_job(jobs, tmp_path / "eager", **accum)[:2]
    assert_bitwise(eager, run_job(jobs, tmp_path / "graph", **accum, **{"compile.mode": "graph"})[:2])


def _on_two_ranks(*configs) -> list[tuple[dict[int, float], dict[str, torch.Tensor]]]:
    """Each config trained on the same 2 gloo ranks in turn: (losses, final full weights) of each."""
    sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the worker by this path
    from conftest import losses
    from graph_ranks import rank_main
    from titan_train_ranks import file_rendezvous

    rendezvous = file_rendezvous(Path(configs[0].job.folder).parent)  # a new file next to the job folders
    mp.start_processes(rank_main, args=(2, rendezvous, list(configs)), nprocs=2, start_method="spawn")
    return [(losses(Path(c.job.folder)), torch.load(Path(c.job.folder) / "final_weights.pt")) for c in configs]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, jobs) -> dict[tuple[str, str], tuple[dict[int, float], dict[str, torch.Tensor]]]:
    """(model, run) -> (losses, final weights) of dense and MoE, eager and graph: 20 steps on the same 2 ranks
    (one spawn for the four runs, not one per model); the length is what the equality is claimed over."""
    root = tmp_path_factory.mktemp("fsdp")
    configs = {}
    for name, model in (("dense", {}), ("moe", MOE)):
        steps = {"training.steps": "20", **model}
        configs[name, "eager"] = jobs.tiny(root / f"{name}_eager", **steps)
        configs[name, "graph"] = jobs.tiny(root / f"{name}_graph", **steps, **ALL_PASSES, **{"compile.mode": "graph"})
    return dict(zip(configs, _on_two_ranks(*configs.values())))


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_fsdp_two_ranks_bitwise_equal_to_eager_fsdp(fsdp_runs, model):
    assert_bitwise(fsdp_runs[model, "eager"], fsdp_runs[model, "graph"])


def test_dump_graph_writes_code_and_op_counts(tmp_path, jobs):
    _, _, trainer = run_job(jobs, tmp_path, **{"training.steps": "1", "compile.mode": "graph",
                                                "compile.dump_graph": "true"})
    gm = next(iter(trainer.graph_step.graphs.values()))
    code = (tmp_path / "graph" / "step0.py").read_text()
    table = (tmp_path / "graph" / "step0_ops.txt").read_text().splitlines()
    mm_nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.mm.default)
    assert code.count("torch.ops.aten.mm.default") == mm_nodes
    assert f"{mm_nodes:6d}  aten.mm.default" in table
    # 2 blocks: 3 projections (q/k/v fused into one) + wo forward, 2 products each backward; the loss's 3
    assert mm_nodes >= 2 * 3 * 3
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in code  # the backward is in the graph


def test_default_passes_remove_what_they_say(tmp_path, jobs):
    _, _, trainer = run_job(jobs, tmp_path / "raw", **{"training.steps": "1", "compile.mode": "graph",
                                                         "compile.graph_passes": ""})
    raw = op_counts(next(iter(trainer.graph_step.graphs.values())))
    _, _, trainer = run_job(jobs, tmp_path / "passes", **{"training.steps": "1", "compile.mode": "graph"})
    cleaned = op_counts(next(iter(trainer.graph_step.graphs.values())))
    assert raw.get("aten.detach.default", 0) + raw.get("aten.alias.default", 0) > 0
    assert "aten.detach.default" not in cleaned and "aten.alias.default" not in cleaned
    assert cleaned["aten.mm.default"] == raw["aten.mm.default"]
    assert {"remove_detach", "eliminate_dead_code", "sink_allocations"} <= set(graph_passes())
    assert all(graph_passes()[name].bitwise for name in ("remove_detach", "eliminate_dead_code", "sink_allocations"))


SEEN: list[int] = []


def count_nodes_pass(gm):
    """A user's pass, named on the command line as module:function."""
    SEEN.append(len(gm.graph.nodes))
    return gm


def test_user_pass_from_the_command_line(tmp_path, jobs):
    sys.path.insert(0, str(Path(__file__).parent))
    SEEN.clear()
    import test_graph_mode as me  # the module object the pass spec resolves to

    me.SEEN.clear()
    run_job(jobs, tmp_path, **{"training.steps": "2", "compile.mode": "graph",
                                "compile.graph_passes": "remove_detach,test_graph_mode:count_nodes_pass"})
    assert len(me.SEEN) == 1 and me.SEEN[0] > 100  # once per captured graph


def test_unsupported_layouts_and_unknown_passes_are_errors(tmp_path, jobs):
    with pytest.raises(ValueError, match="activation_checkpoint.mode=none"):
        Trainer(jobs.tiny(tmp_path / "a", **{"compile.mode": "graph", "activation_checkpoint.mode": "full"}),
                torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'"):
        Trainer(jobs.tiny(tmp_path / "b", **{"compile.mode": "graph", "compile.graph_passes": "fuse_everything"}),
                torch.device("cpu"))
    with pytest.raises(ValueError, match="runs titan-models' MoE layers only, not dist-moe's"):
        Trainer(jobs.tiny(tmp_path / "d", "deepseek_v3_debug_ep", **{"compile.mode": "graph", "parallelism.ep": "1",
                                                                   "model.moe_impl": "dist_moe"}),
                torch.device("cpu"))
    with pytest.raises(ValueError, match="conflicts with compile.mode=graph"):
        Trainer(jobs.tiny(tmp_path / "c", **{"compile.mode": "graph", "compile.enabled": "true"}),
                torch.device("cpu"))


def _peak_live_bytes(gm, *args) -> int:
    """Peak bytes of the values an fx.Interpreter holds (it frees each after its last use)."""
    import torch.fx as fx
    import torch.utils._pytree as pytree

    class Peak(fx.Interpreter):
        peak = 0

        def run_node(self, n):
            out = super().run_node(n)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for v in self.env.values() for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)}
            self.peak = max(self.peak, sum(storages.values()))
            return out

    interpreter = Peak(gm)
    interpreter.run(*args)
    return interpreter.peak


def test_sink_allocations_lowers_the_peak_of_an_early_op_and_keeps_values():
    from torch.fx.experimental.proxy_tensor import make_fx

    from titan_train.graph.passes import sink_allocations

    def step(x, y):
        early = x * 2                # traced first, needed last: 1 MiB held across the reduction of y
        reduced = (y * 3).sum()
        return early + reduced + x   # x stays alive to the end either way

    x, y = torch.randn(1 << 18), torch.randn(1 << 18)
    gm = make_fx(step)(x, y)
    before = _peak_live_bytes(gm, x, y)
    sunk = sink_allocations(make_fx(step)(x, y))
    sunk.recompile()
    assert torch.equal(sunk(x, y), gm(x, y))
    # one [2^18] fp32 buffer fewer at the peak; the 4-byte sum is alive at the new one
    assert _peak_live_bytes(sunk, x, y) == before - (1 << 20) + 4
