"""FSDP, TP and FSDP x TP on gloo ranks follow the single-process loss curve of the same job.

Tolerance: titan_train_curves.assert_follows (1e-4 relative for the first three steps, then a bound that doubles
per step, for the amplified rounding of sums taken in another order: reduce-scatter of gradients,
matmuls split over ranks, the global gradient norm).
"""
from __future__ import annotations

import pytest

from titan_train import train


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    result = train(jobs.tiny(tmp_path_factory.mktemp("single"), **{"training.steps": "10"}))
    assert sorted(result.losses) == list(range(1, 11))
    assert result.losses[10] < result.losses[1] - 1.0, f"the tiny job should learn: {result.losses}"
    return result.losses


@pytest.mark.parametrize("nproc,layout", [
    (2, {"parallelism.dp_shard": "2"}),
    (2, {"parallelism.tp": "2"}),
    # Selective checkpointing rides along: recomputation must not change the numbers either.
    (4, {"parallelism.dp_shard": "2", "parallelism.tp": "2", "activation_checkpoint.mode": "selective"}),
    (4, {"parallelism.dp_replicate": "2", "parallelism.dp_shard": "2", "training.grad_accum_steps": "2",
         "training.batch_size": "8", "training.steps": "3"}),
], ids=["fsdp2", "tp2", "fsdp2xtp2", "hsdp2x2-accum2"])
def test_parallel_layout_follows_single_process(reference, tmp_path, jobs, nproc, layout):
    if "training.batch_size" in layout:
        # Gradient accumulation splits the same global batch: compare with one process, no accumulation.
        base = {k: v for k, v in layout.items() if not k.startswith("parallelism") and k != "training.grad_accum_steps"}
        expected = train(jobs.tiny(tmp_path / "single", **base)).losses
    else:
        expected = reference
    curve = jobs.on_ranks(jobs.tiny(tmp_path, **{"training.steps": "10", **layout}), nproc)
    jobs.assert_follows(curve, expected)


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
def test_fsdp_follows_single_process_for_a_linear_attention_model(tmp_path, jobs, family):
    # The debug model cut to 2 layers: one Gated DeltaNet layer (Kimi: Kimi Delta Attention; its conv / decay
    # parameters read directly in the forward) and one attention layer (Qwen3.5: gated attention; Kimi:
    # RoPE-free MLA with an MoE), at 80 tokens (past the 64-token chunk).
    job = {"model.family": family, "model.flavor": "debug", "model.vocab_size": "384", "training.seq_len": "80",
           "training.steps": "6"}
    expected = train(jobs.tiny(tmp_path / "single", **job)).losses
    curve = jobs.on_ranks(jobs.tiny(tmp_path / "fsdp", **job, **{"parallelism.dp_shard": "2"}), 2)
    assert sorted(curve) == sorted(expected) and expected[6] < expected[1]
    for step, loss in expected.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, expected)


@pytest.mark.parametrize("nproc,layout", [(2, {"parallelism.tp": "2"}),
                                          (4, {"parallelism.tp": "2", "parallelism.dp_shard": "2"})],
                         ids=["tp2", "fsdp2xtp2"])
def test_tensor_parallel_splits_linear_attention_heads(tmp_path, jobs, nproc, layout):
    # Qwen3.5 debug, 2 layers: the Gated DeltaNet's key/value heads (projections colwise, short convs and
    # decay gate headwise) and the gated attention's heads (q/k norms replicated, their gradients summed)
    # split over 2 ranks, sequence parallel between them.
    job = {"model.family": "qwen3_5", "model.flavor": "debug", "model.vocab_size": "384", "training.seq_len": "80",
           "training.steps": "6"}
    expected = train(jobs.tiny(tmp_path / "single", **job)).losses
    curve = jobs.on_ranks(jobs.tiny(tmp_path / "tp", **job, **layout), nproc)
    jobs.assert_follows(curve, expected)
    # the gradient norm sees every gradient, the replicated norms' summed ones included (Adam's
    # scale-free first steps would hide a missing sum from the loss alone)
    norms = [_grad_norms(tmp_path / folder) for folder in ("single", "tp")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


def test_tensor_parallel_splits_kimi_delta_attention_heads(tmp_path, jobs):
    # Kimi Linear's first layer alone (KDA + a dense FFN; its MoE layers need EP, which does not compose with
    # TP yet): q/k/v/b and the low-rank gates' up projections colwise, their down projections replicated
    # (gradients summed), the per-channel decay and the convs headwise, over 2 ranks.
    job = {"model.family": "kimi_linear", "model.flavor": "debug", "model.vocab_size": "384",
           "model.num_layers": "1", "training.seq_len": "80", "training.steps": "6"}
    expected = train(jobs.tiny(tmp_path / "single", **job)).losses
    curve = jobs.on_ranks(jobs.tiny(tmp_path / "tp", **job, **{"parallelism.tp": "2"}), 2)
    assert sorted(curve) == sorted(expected) and expected[6] < expected[1]
    for step, loss in expected.items():
        assert curve[step] == pytest.approx(loss, rel=1e-4), (step, curve, expected)
    norms = [_grad_norms(tmp_path / folder) for folder in ("single", "tp")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


def _grad_norms(folder):
    import json

    return [json.loads(line)["grad_norm"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _local_values_rank(rank: int, port: int, out) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from titan_models.components.gated_deltanet import DecayGate
    from titan_models.components.norms import ZeroCenteredRMSNorm
    from titan_train.parallelize import _compute_on_local_values

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
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


def test_replicated_and_headwise_parameters_get_the_whole_gradient():
    import socket

    import torch
    import torch.multiprocessing as mp
    from titan_train_ranks import spawn_ranks

    from titan_models.components.gated_deltanet import DecayGate
    from titan_models.components.norms import ZeroCenteredRMSNorm

    manager = mp.Manager()
    out = manager.dict()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_local_values_rank, 2, (port, out))  # spawn: earlier tests of the session ran autograd
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
