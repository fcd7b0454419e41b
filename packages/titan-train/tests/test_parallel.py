"""FSDP, TP and FSDP x TP on gloo ranks follow the single-process loss curve of the same job.

Tolerance: titan_train_curves.assert_follows (1e-4 relative for the first three steps, then a bound that doubles
per step, for the amplified rounding of sums taken in another order: reduce-scatter of gradients,
matmuls split over ranks, the global gradient norm).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_train import train


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    result = train(jobs.tiny(tmp_path_factory.mktemp("single"), **{"training.steps": "10"}))
    assert sorted(result.losses) == list(range(1, 11))
    assert result.losses[10] < result.losses[1] - 1.0, f"the tiny job should learn: {result.losses}"
    return result.losses


# Gradient accumulation splits the same global batch: compared with one process, no accumulation.
HSDP_ACCUM = {"training.batch_size": "8", "training.steps": "3"}
LAYOUTS = {  # id -> (ranks, overrides) of the tiny job
    "fsdp2": (2, {"parallelism.dp_shard": "2"}),
    "tp2": (2, {"parallelism.tp": "2"}),
    # Selective checkpointing rides along: recomputation must not change the numbers either.
    "fsdp2xtp2": (4, {"parallelism.dp_shard": "2", "parallelism.tp": "2", "activation_checkpoint.mode": "selective"}),
    "hsdp2x2-accum2": (4, {"parallelism.dp_replicate": "2", "parallelism.dp_shard": "2",
                           "training.grad_accum_steps": "2", **HSDP_ACCUM}),
}


def linear_attention_job(family: str, **overrides: str) -> dict[str, str]:
    # The debug model cut to 2 layers: one Gated DeltaNet layer (Kimi: Kimi Delta Attention; its conv / decay
    # parameters read directly in the forward) and one attention layer (Qwen3.5: gated attention; Kimi:
    # RoPE-free MLA with an MoE), at 80 tokens (past the 64-token chunk).
    return {"model.family": family, "model.flavor": "debug", "model.vocab_size": "384", "training.seq_len": "80",
            "training.steps": "6", **overrides}


# Kimi Linear's first layer alone (KDA + a dense FFN; its MoE layers need EP, which does not compose with TP yet).
KDA = linear_attention_job("kimi_linear", **{"model.num_layers": "1"})
LINEAR_RUNS = {  # id -> (ranks, job, parallelism)
    "qwen3_5-fsdp2": (2, linear_attention_job("qwen3_5"), {"parallelism.dp_shard": "2"}),
    "kimi_linear-fsdp2": (2, linear_attention_job("kimi_linear"), {"parallelism.dp_shard": "2"}),
    "qwen3_5-tp2": (2, linear_attention_job("qwen3_5"), {"parallelism.tp": "2"}),
    "qwen3_5-fsdp2xtp2": (4, linear_attention_job("qwen3_5"), {"parallelism.tp": "2", "parallelism.dp_shard": "2"}),
    "kda-tp2": (2, KDA, {"parallelism.tp": "2"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, jobs) -> dict[str, Path]:
    """id -> job folder of every gloo run of LAYOUTS (10 steps, HSDP 3) and LINEAR_RUNS, and of the single
    processes they follow (single-ID; the linear-attention ones shared by the runs of the same job); the runs
    of one rank count in one spawn."""
    root = tmp_path_factory.mktemp("runs")
    parallel = {name: (n, {"training.steps": "10", **layout}) for name, (n, layout) in LAYOUTS.items()}
    parallel.update({name: (n, {**job, **layout}) for name, (n, job, layout) in LINEAR_RUNS.items()})
    singles = {"single-hsdp2x2-accum2": HSDP_ACCUM}
    singles.update({f"single-{name}": job for name, (_, job, _) in LINEAR_RUNS.items()})
    done = {}
    for name, job in singles.items():
        key = tuple(sorted(job.items()))
        if key not in done:
            done[key] = root / name
            train(jobs.tiny(root / name, **job))
    folders = {name: done[tuple(sorted(job.items()))] for name, job in singles.items()}
    for nproc in (2, 4):
        names = [name for name, (n, _) in parallel.items() if n == nproc]
        jobs.each_on_ranks([jobs.tiny(root / name, **parallel[name][1]) for name in names], nproc)
        folders.update({name: root / name for name in names})
    return folders


@pytest.mark.parametrize("name", LAYOUTS)
def test_parallel_layout_follows_single_process(reference, runs, jobs, name):
    expected = _losses(runs["single-" + name]) if name == "hsdp2x2-accum2" else reference
    jobs.assert_follows(_losses(runs[name]), expected)


def test_torchrun_runs_the_command_on_gloo_ranks(tmp_path, cli, jobs):
    """`torchrun -m titan_train` (the real command, each process one rank) matches train() in one process."""
    steps = {"training.steps": "3"}
    expected = train(jobs.tiny(tmp_path / "single", **steps)).losses
    folder = tmp_path / "torchrun"
    result = cli.run([*cli.TINY, "--training.steps", "3", "--parallelism.dp_shard", "2", "--job.folder", str(folder)],
                     nproc=2)
    assert "dp_shard=2" in result.stdout and result.stdout.count("titan-train: done") == 1  # rank 0 reports
    curve = cli.losses(folder)
    assert sorted(curve) == [1, 2, 3]
    for step, loss in expected.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_fsdp_follows_single_process_for_a_linear_attention_model(runs, family):
    curve, expected = _losses(runs[f"{family}-fsdp2"]), _losses(runs[f"single-{family}-fsdp2"])
    assert sorted(curve) == sorted(expected) and expected[6] < expected[1]
    for step, loss in expected.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, expected)


@pytest.mark.parametrize("name", ["qwen3_5-tp2", "qwen3_5-fsdp2xtp2"])
def test_tensor_parallel_splits_linear_attention_heads(runs, jobs, name):
    # Qwen3.5 debug, 2 layers: the Gated DeltaNet's key/value heads (projections colwise, short convs and
    # decay gate headwise) and the gated attention's heads (q/k norms replicated, their gradients summed)
    # split over 2 ranks, sequence parallel between them.
    jobs.assert_follows(_losses(runs[name]), _losses(runs[f"single-{name}"]))
    # the gradient norm sees every gradient, the replicated norms' summed ones included (Adam's
    # scale-free first steps would hide a missing sum from the loss alone)
    assert _grad_norms(runs[name]) == pytest.approx(_grad_norms(runs[f"single-{name}"]), rel=1e-4)


def test_tensor_parallel_splits_kimi_delta_attention_heads(runs):
    # q/k/v/b and the low-rank gates' up projections colwise, their down projections replicated (gradients
    # summed), the per-channel decay and the convs headwise, over 2 ranks.
    curve, expected = _losses(runs["kda-tp2"]), _losses(runs["single-kda-tp2"])
    assert sorted(curve) == sorted(expected) and expected[6] < expected[1]
    for step, loss in expected.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, expected)
    assert _grad_norms(runs["kda-tp2"]) == pytest.approx(_grad_norms(runs["single-kda-tp2"]), rel=1e-4)


def _losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())}


def _grad_norms(folder: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _local_values_rank(rank: int, init_method: str, out) -> None:
    import os

    import torch
    import torch.distributed as dist
    from titan_train_ranks import join_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from titan_models.components.gated_deltanet import DecayGate
    from titan_models.components.norms import ZeroCenteredRMSNorm
    from titan_train.parallelize import _compute_on_local_values

    join_gloo(rank, 2, init_method)
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(2, 5, 4, 8, generator=gen), torch.randn(2, 5, 4, generator=gen)  # 4 heads
    norm, gate = ZeroCenteredRMSNorm(8), DecayGate(4)
    with torch.no_grad():
        for p in (norm.weight, gate.A_log, gate.dt_bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    heads = slice(2 * rank, 2 * rank + 2)
    _compute_on_local_values(norm, mesh, Replicate())  # per-head norm over this rank's 2 heads
    _compute_on_local_values(gate, mesh, Shard(0))  # this rank's 2 heads' decay parameters
    (norm(x[:, :, heads]).square().sum() + gate(a[:, :, heads]).square().sum()).backward()
    out[rank] = [p.grad.full_tensor() for p in (norm.weight, gate.A_log, gate.dt_bias)]
    dist.destroy_process_group()
    os._exit(0)


def test_replicated_and_headwise_parameters_get_the_whole_gradient(tmp_path):
    import torch
    import torch.multiprocessing as mp
    from titan_train_ranks import file_rendezvous, spawn_ranks

    from titan_models.components.gated_deltanet import DecayGate
    from titan_models.components.norms import ZeroCenteredRMSNorm

    manager = mp.Manager()
    out = manager.dict()
    # spawned: earlier tests of the session ran autograd
    spawn_ranks(_local_values_rank, 2, (file_rendezvous(tmp_path), out))
    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(2, 5, 4, 8, generator=gen), torch.randn(2, 5, 4, generator=gen)
    norm, gate = ZeroCenteredRMSNorm(8), DecayGate(4)
    with torch.no_grad():
        for p in (norm.weight, gate.A_log, gate.dt_bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    (norm(x).square().sum() + gate(a).square().sum()).backward()
    for rank in range(2):
        for got, want in zip(out[rank], (norm.weight.grad, gate.A_log.grad, gate.dt_bias.grad)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
