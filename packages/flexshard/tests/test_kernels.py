"""Blockwise fp8 quantization, Newton–Schulz and the Muon/AdamW update rules against float64
references written out here (single process)."""
from __future__ import annotations

import math

import pytest
import torch

from flexshard import dequantize_blockwise, quantize_blockwise
from flexshard.optim import Muon, default_muon_rule, newton_schulz, newton_schulz_flops

E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3 = torch.unique(E4M3[torch.isfinite(E4M3)])  # every finite e4m3fn value, ascending


def awkward_matrix() -> torch.Tensor:
    """[70, 100]: edge tiles, an all-zero tile, tiles of very different ranges."""
    torch.manual_seed(0)
    x = torch.randn(70, 100)
    x[:32, :48] *= 1e4
    x[32:64, 48:96] *= 1e-4
    x[64:, 96:] = 0
    return x


def test_quantize_matches_float64_nearest_e4m3():
    x, block = awkward_matrix(), (32, 48)
    q, scales = quantize_blockwise(x, block)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 3)
    x64 = x.double()
    for i in range(3):
        for j in range(3):
            tile = x64[i * 32 : (i + 1) * 32, j * 48 : (j + 1) * 48]
            amax = tile.abs().max()
            want = amax / 448 if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
            assert abs(scales[i, j].item() - want.item()) <= 1e-7 * want.item()  # fp32 rounding of amax/448
    scaled = x64 / torch.repeat_interleave(torch.repeat_interleave(scales.double(), 32, 0), 48, 1)[:70, :100]
    nearest = E4M3[(scaled.unsqueeze(-1) - E4M3).abs().argmin(-1)]
    got = q.double()
    mismatch = got != nearest
    # Only exact ties may round differently (round-half-even picks the even mantissa); none here.
    assert not mismatch.any(), scaled[mismatch][:5]
    assert q.double().abs().max() == 448  # each tile's largest element lands on the top code


def test_dequantize_error_bound():
    x, block = awkward_matrix(), (32, 48)
    q, scales = quantize_blockwise(x, block)
    back = dequantize_blockwise(q, scales, block, torch.float32)
    scale_of = torch.repeat_interleave(torch.repeat_interleave(scales, 32, 0), 48, 1)[:70, :100]
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormal spacing 2^-9 of the scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale_of * 2**-10).all()
    assert torch.equal(back[64:, 96:], torch.zeros(6, 4))


def test_quantizing_a_tile_aligned_piece_gives_the_same_bits():
    x, block = awkward_matrix().bfloat16(), (16, 32)
    q, s = quantize_blockwise(x, block)
    for r0, r1, c0, c1 in ((0, 16, 0, 100), (16, 70, 32, 100), (48, 64, 64, 96), (64, 70, 96, 100)):
        qp, sp = quantize_blockwise(x[r0:r1, c0:c1], block)
        assert torch.equal(qp.view(torch.uint8), q[r0:r1, c0:c1].view(torch.uint8))
        assert torch.equal(sp, s[r0 // 16 : -(-r1 // 16), c0 // 32 : -(-c1 // 32)])


def test_pow2_scales_match_float64_nearest_e4m3():
    """scales="pow2": each tile's scale is 2^-p with p the largest integer such that amax * 2^p <= 448 (found
    here by stepping p in float64, not by frexp), 1 for an all-zero tile; q is the nearest e4m3 of x * 2^p, and
    q * scale dequantizes without rounding."""
    x, block = awkward_matrix(), (32, 48)
    q, scales = quantize_blockwise(x, block, scales="pow2")
    x64 = x.double()
    for i in range(3):
        for j in range(3):
            amax = x64[i * 32 : (i + 1) * 32, j * 48 : (j + 1) * 48].abs().max().item()
            p = 0
            if amax > 0:
                p = -200
                while amax * 2.0 ** (p + 1) <= 448:
                    p += 1
            assert scales[i, j].item() == 2.0 ** -p, (i, j, amax, scales[i, j].item())
    scale_of = torch.repeat_interleave(torch.repeat_interleave(scales.double(), 32, 0), 48, 1)[:70, :100]
    scaled = x64 / scale_of
    nearest = E4M3[(scaled.unsqueeze(-1) - E4M3).abs().argmin(-1)]
    assert torch.equal(q.double(), nearest)
    assert torch.equal(dequantize_blockwise(q, scales, block, torch.float64), q.double() * scale_of)
    qp, sp = quantize_blockwise(x[32:64, 48:], block, scales="pow2")  # a tile-aligned piece: the same bits
    assert torch.equal(qp.view(torch.uint8), q[32:64, 48:].view(torch.uint8)) and torch.equal(sp, scales[1:2, 1:])


def test_gathered_fp8_is_held_between_gather_and_reshard():
    """One gloo rank in this process: after a forward's gather the unsharded weight carries what the gather
    carried (flexshard.gathered_fp8: e4m3 + scales, equal to quantizing the weight); resharding drops it."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import flexshard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96, bias=False))
        whole = model[0].weight.detach().clone()
        seen = []
        model[0].register_forward_pre_hook(lambda m, args: seen.append(flexshard.gathered_fp8(m.weight)))
        placement = flexshard.BlockShard(block=(32, 32), quantize="fp8_e4m3", scales="pow2")
        flexshard.shard(model, init_device_mesh("cpu", (1,)), placements=placement)
        model(torch.randn(2, 64)).sum().backward()
        (gathered,) = seen
        q, s = quantize_blockwise(whole, (32, 32), scales="pow2")
        assert gathered.block == (32, 32) and gathered.rule == "pow2"
        assert torch.equal(gathered.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(gathered.scales, s)
        slot = flexshard.layout(model).buckets[0][1].slots[0]
        assert flexshard.gathered_fp8(slot.unsharded) is None  # resharded after backward
    finally:
        dist.destroy_process_group()


def newton_schulz_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration written out in float64 on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


@pytest.mark.parametrize("shape", [(24, 40), (72, 24), (64, 64)])
def test_newton_schulz_matches_float64(shape):
    torch.manual_seed(1)
    g = torch.randn(shape)
    want = newton_schulz_float64(g)
    assert torch.allclose(newton_schulz(g, dtype=torch.float32).double(), want, atol=1e-5)
    assert torch.allclose(newton_schulz(g, dtype=torch.bfloat16).double(), want, atol=0.05)  # bf16: 8 mantissa bits
    sv = torch.linalg.svdvals(want)
    assert sv.min() > 0.5 and sv.max() < 1.3  # roughly orthogonal, as Muon wants


def test_newton_schulz_batches_and_counts_flops():
    torch.manual_seed(2)
    g = torch.randn(3, 16, 24)
    batched = newton_schulz(g, dtype=torch.float32)
    for i in range(3):
        assert torch.allclose(batched[i], newton_schulz(g[i], dtype=torch.float32), atol=1e-6)
    assert newton_schulz_flops((3, 16, 24)) == 3 * 5 * (2 * 16 * 16 * 24 * 2 + 2 * 16**3)
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(5))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["spectral", "match_adamw_rms", None])
def test_muon_update_matches_float64_reference(nesterov, adjust_lr):
    torch.manual_seed(3)
    w = torch.randn(12, 20, dtype=torch.float64)
    param = torch.nn.Parameter(w.clone())
    opt = Muon([("w", param)], lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01, adjust_lr=adjust_lr, ns_dtype=torch.float64)
    buf, ref = torch.zeros_like(w), w.clone()
    scale = {"spectral": 1.0, "match_adamw_rms": 0.2 * math.sqrt(20), None: 1.0}[adjust_lr]
    for _ in range(3):
        grad = torch.randn(12, 20, dtype=torch.float64)
        param.grad = grad.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * grad
        update = (grad + 0.9 * (buf - grad)) if nesterov else buf
        ref = ref * (1 - 0.1 * 0.01) - 0.1 * scale * newton_schulz_float64(update)
    assert torch.allclose(param.detach(), ref, atol=1e-10)
    tall = torch.nn.Parameter(torch.zeros(40, 10, dtype=torch.float64))
    tall.grad = torch.randn(40, 10, dtype=torch.float64)
    Muon([("w", tall)], lr=1.0, momentum=0.0, ns_dtype=torch.float64).step()
    assert torch.allclose(tall.detach(), -2.0 * newton_schulz_float64(tall.grad), atol=1e-10)  # sqrt(40 / 10)


def test_muon_adamw_part_equals_torch_adamw():
    torch.manual_seed(4)
    a = torch.nn.Parameter(torch.randn(37, 24))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([("tok_embeddings.weight", a)], adamw_lr=1e-2, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.1)
    theirs = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(4):
        g = torch.randn(37, 24)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_muon_rule():
    m, v = torch.empty(4, 4), torch.empty(4)
    assert default_muon_rule("layers.0.attention.wq.weight", m)
    assert default_muon_rule("layers.0.moe.experts.w1", torch.empty(2, 4, 4))
    assert not default_muon_rule("tok_embeddings.weight", m)
    assert not default_muon_rule("output.weight", m)
    assert not default_muon_rule("lm_head.weight", m)
    assert not default_muon_rule("layers.0.ffn_norm.weight", v)
    opt = Muon([("a", torch.nn.Parameter(m.clone())), ("b", torch.nn.Parameter(v.clone()))], use_muon=lambda n, p: n == "b")
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["params"][0].dim() == 1
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([m], adjust_lr="rms")
    with pytest.raises(ValueError, match="no parameters"):
        Muon([])
