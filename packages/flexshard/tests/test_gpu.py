"""On a GPU machine: the same code paths with nccl and CUDA tensors (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

import flexshard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nccl)")


def test_quantize_bits_do_not_depend_on_the_device():
    """The fp8 gather's bitwise claim holds across devices too: CPU and CUDA quantize alike."""
    torch.manual_seed(0)
    x = (torch.randn(300, 520) * torch.logspace(-3, 3, 520)).bfloat16()
    q_cpu, s_cpu = flexshard.quantize_blockwise(x, (128, 128))
    q_gpu, s_gpu = flexshard.quantize_blockwise(x.cuda(), (128, 128))
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs: a 1-rank world shards nothing and its collectives copy")


def _all_placements(quantize):
    import flexshard
    from flexshard.optim import default_muon_rule

    def placement(name, p):
        if default_muon_rule(name, p):
            return flexshard.Owned()
        if p.dim() == 2:
            return flexshard.BlockShard(block=(16, 16), quantize=quantize)
        return flexshard.RowShard()
    return placement


def gpu_worker(rank, world, quantize):
    """Three Muon steps of a model sharded over `world` GPUs (Owned, BlockShard, RowShard) against
    one process training on the global batch. quantize=None: fp32 everywhere and fp32 Newton–Schulz,
    as tests/test_muon.py's CPU twin; "fp8_e4m3": bf16 parameters and fp8-gathered matrices against
    bf16 autocast. Also how far the reference moved from its initial weights (a model that never
    updated is that far off)."""
    from torch.distributed.device_mesh import init_device_mesh

    import flexshard
    from flexshard.optim import Muon
    from flexshard_testmodel import batch, loss_fn, make_model

    mesh = init_device_mesh("cuda", (world,))
    ref, ours = make_model().cuda(), make_model()  # ours is sharded from CPU onto the GPU
    initial = [q.detach().clone() for q in ref.parameters()]
    mp = flexshard.MixedPrecision(param_dtype=torch.bfloat16) if quantize else None
    for layer in ours.layers:
        flexshard.shard(layer, mesh, placements=_all_placements(quantize), mp_policy=mp)
    flexshard.shard(ours, mesh, placements=_all_placements(quantize), mp_policy=mp)
    kwargs = {} if quantize else {"ns_dtype": torch.float32}
    opt, ref_opt = Muon(ours.named_parameters(), **kwargs), Muon(ref.named_parameters(), **kwargs)
    for step in range(3):
        tokens, targets = (t.cuda() for t in batch(step, 2 * world))
        rows = slice(2 * rank, 2 * rank + 2)
        loss_fn(ours(tokens[rows]), targets[rows]).backward()
        with flexshard.CollectiveCounter() as counter:
            opt.step()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=quantize is not None):
            ref_loss = loss_fn(ref(tokens), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    pairs = list(zip(ours.parameters(), ref.parameters(), initial))
    diff = max((flexshard.full_tensor(p) - q).abs().max().item() for p, q, _ in pairs)
    moved = max((q - q0).abs().max().item() for _, q, q0 in pairs)
    return {"device": str(next(ours.parameters()).device), "step_collectives": counter.count, "diff": diff,
            "moved": moved}


@TWO_GPUS
def test_nccl_fp32_training_with_all_placements_matches_one_process():
    """fp32: the gradients differ from one process's by rounding only (two half-batch averages), as in
    the CPU twin (tests/test_muon.py, same 1e-5 bound); the control: a model that never updated
    misses the bound by far."""
    from flexshard_ranks import run_ranks

    for r in run_ranks(gpu_worker, world=2, backend="nccl", quantize=None):
        assert r["device"].startswith("cuda")
        assert r["step_collectives"] == 0  # Owned matrices: Newton–Schulz on the owner, no collective
        assert r["diff"] < 1e-5, r
        assert r["moved"] > 100 * 1e-5, r


@TWO_GPUS
def test_nccl_fp8_training_with_all_placements_stays_near_one_process():
    """bf16 parameters with fp8-gathered matrices against bf16 autocast: not equal (e4m3 keeps ~2
    digits), but nearer the reference than a model that never updated is, by 4x."""
    from flexshard_ranks import run_ranks

    for r in run_ranks(gpu_worker, world=2, backend="nccl", quantize="fp8_e4m3"):
        print(f"fp8 on nccl: max |ours - reference| {r['diff']:.3g}, reference moved {r['moved']:.3g}")
        assert r["device"].startswith("cuda")
        assert r["step_collectives"] == 0
        assert r["diff"] < 0.25 * r["moved"], r
