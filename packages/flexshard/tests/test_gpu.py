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


def gpu_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from flexshard.optim import Muon, default_muon_rule
    from flexshard_testmodel import batch, loss_fn, make_model

    mesh = init_device_mesh("cuda", (world,))
    ref, ours = make_model().cuda(), make_model()  # ours is sharded from CPU onto the GPU

    def placement(name, p):
        if default_muon_rule(name, p):
            return flexshard.Owned()
        if p.dim() == 2:
            return flexshard.BlockShard(block=(16, 16), quantize="fp8_e4m3")
        return flexshard.RowShard()

    mp = flexshard.MixedPrecision(param_dtype=torch.bfloat16)
    for layer in ours.layers:
        flexshard.shard(layer, mesh, placements=placement, mp_policy=mp)
    flexshard.shard(ours, mesh, placements=placement, mp_policy=mp)
    opt, ref_opt = Muon(ours.named_parameters()), Muon(ref.named_parameters())
    for step in range(3):
        tokens, targets = (t.cuda() for t in batch(step, 2 * world))
        rows = slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(ours(tokens[rows]), targets[rows])
        loss.backward()
        with flexshard.CollectiveCounter() as counter:
            opt.step()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = loss_fn(ref(tokens), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max((flexshard.full_tensor(p) - q).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))
    return {"device": str(next(ours.parameters()).device), "step_collectives": counter.count, "diff": diff}


def test_nccl_training_with_all_placements():
    from flexshard_ranks import run_ranks

    world = min(torch.cuda.device_count(), 2)
    for r in run_ranks(gpu_worker, world=world, backend="nccl"):
        assert r["device"].startswith("cuda")
        assert r["step_collectives"] == 0
        # bf16 compute (and fp8-gathered embedding/head) against bf16 autocast: loose, O(1) weights
        assert r["diff"] < 0.05, r["diff"]
