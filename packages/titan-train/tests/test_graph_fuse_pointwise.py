"""fuse_pointwise: chains of pointwise ops with single-use intermediates become one submodule each (the
step stays eager's bit for bit while they run as captured, on CPU), and compiled by Inductor they differ
from the unfused graph by a measured amount (why the pass is registered bitwise=False)."""
from __future__ import annotations

import pytest
import torch
from test_graph_mode import assert_bitwise, run_job
from torch.fx.experimental.proxy_tensor import make_fx

from titan_train.graph import graph_passes, op_counts
from titan_train.graph.fuse_pointwise import fuse_chains, pointwise_chains
from titan_train.trainer import Trainer


def gelu_tanh_plus_exp(x, y):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1 + torch.tanh(inner)) + y.exp()


def test_chains_are_single_use_pointwise_paths():
    x, y = torch.randn(64), torch.randn(64)
    chains = pointwise_chains(make_fx(gelu_tanh_plus_exp)(x, y))
    # x*0.044715*x*x + x, *0.798, tanh, +1, *(0.5x), + exp(y): one path of 9 ops; 0.5*x and exp(y) feed
    # into it from outside (their users are already in the chain), so they stay unfused
    assert [len(c) for c in chains] == [9]
    assert all(len(n.users) == 1 and next(iter(n.users)) is nxt for n, nxt in zip(chains[0], chains[0][1:]))


def test_an_in_place_write_cuts_a_chain():
    def step(x, buf):
        a = x * 2
        buf.add_(1)          # a write between a and its user: a's op may not move past it
        return a + buf

    assert pointwise_chains(make_fx(step)(torch.randn(4), torch.zeros(4))) == []


def test_inductor_on_cpu_differs_from_the_unfused_graph_by_a_few_ulps():
    """The measured difference (CPU, fp32, 2^16 values, seed 0): 0.98 ulp of the result, 1.2e-7 absolute
    here; a float64 reference shows neither is worse than a few ulp."""
    torch.manual_seed(0)
    x, y = torch.randn(1 << 16), torch.randn(1 << 16)
    unfused = make_fx(gelu_tanh_plus_exp)(x, y)(x, y)
    fused_gm = fuse_chains(make_fx(gelu_tanh_plus_exp)(x, y), compile_on=("cpu",))
    fused_gm.recompile()
    assert op_counts(fused_gm)["module PointwiseChain"] == 1
    fused = fused_gm(x, y)
    exact = gelu_tanh_plus_exp(x.double(), y.double())
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(1.0)
    difference = ((fused - unfused).double().abs() / ulp).max().item()
    print(f"fused vs unfused: {difference:.2f} ulp, max abs {(fused - unfused).abs().max().item():.3g}")
    assert difference <= 4
    for values in (fused, unfused):
        assert ((values.double() - exact).abs() / ulp).max() <= 4
    assert graph_passes()["fuse_pointwise"].bitwise is False


def test_step_with_chains_grouped_is_bitwise_on_cpu(tmp_path, jobs):
    """The registered pass on CPU groups the real step's chains (forward and backward) without compiling:
    the rewiring keeps every value, over 5 steps."""
    run = {"training.steps": "5", "compile.mode": "graph"}
    eager = run_job(jobs, tmp_path / "eager", **run)[:2]
    losses, weights, trainer = run_job(jobs, tmp_path / "fused", **run, **{
        "compile.graph_passes": "remove_detach,eliminate_dead_code,fuse_pointwise", "compile.dump_graph": "true"})
    assert_bitwise(eager, (losses, weights))
    gm = next(iter(trainer.graph_step.graphs.values()))
    chains = [m for m in gm.children() if hasattr(m, "ops")]
    assert len(chains) >= 4 and all(len(m.ops) >= 2 for m in chains)
    table = (tmp_path / "fused" / "graph" / "step0_ops.txt").read_text()
    assert f"{len(chains):6d}  module PointwiseChain" in table and "pointwise_chain_0: " in table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chains are compiled by Inductor on CUDA only")
def test_compiled_chains_on_cuda_follow_the_unfused_step(tmp_path, jobs):
    """bf16 on the GPU, 20 steps: the step with Inductor-compiled chains against the unfused graph step;
    prints the largest relative loss difference (the figure the pass's bitwise=False stands for)."""
    run = {"job.device": "cuda", "training.fused_kernels": "false", "training.steps": "20", "compile.mode": "graph"}
    losses = []
    for name, passes in (("unfused", "remove_detach,eliminate_dead_code"),
                         ("fused", "remove_detach,eliminate_dead_code,fuse_pointwise")):
        trainer = Trainer(jobs.tiny(tmp_path / name, **run, **{"compile.graph_passes": passes}), torch.device("cuda"))
        losses.append(trainer.run().losses)
    gm = next(iter(trainer.graph_step.graphs.values()))
    chains = [m for m in gm.children() if hasattr(m, "ops")]
    assert chains and all(m.run is not m.graph_module for m in chains)  # each one compiled
    worst = max(abs(losses[1][s] - losses[0][s]) / abs(losses[0][s]) for s in losses[0])
    print(f"fuse_pointwise on CUDA: {len(chains)} chains, largest relative loss difference {worst:.3g}")
    assert worst < 2e-2
