"""The remat planner's meta profile of the fused SwiGLU (kernels/swiglu.py), which a CUDA run swaps into every
FeedForward: its backward holds what the Triton kernel does (its bf16 output), not the fp32 temporaries of the
torch reference, which priced each 8B block 3 GiB above the GPU and raised the planner's floor past the budget
that full checkpointing's measured peak fits in. A fake tensor standing in for a CUDA one still takes the kernel."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import titan_models
from titan_train.kernels import swiglu as sw
from titan_train.remat import profile_blocks
from titan_train.remat.held import LiveStorages
from titan_train.remat.plan import OPTIONS

ROWS, SEQ = 2, 64


def _backward_high(fn, gate_up, grad_h) -> tuple[int, torch.Tensor]:
    live = LiveStorages({gate_up.untyped_storage()._cdata, grad_h.untyped_storage()._cdata})
    with live:
        out = fn(gate_up, grad_h)
    return live.high, out


def _fp32_excess(ffn: int, tokens: int) -> int:
    """What the torch reference holds above the kernel's output for a [tokens, 2 ffn] bf16 gate_up on meta."""
    gate_up = torch.empty(tokens, 2 * ffn, dtype=torch.bfloat16, device="meta")
    grad_h = torch.empty(tokens, ffn, dtype=torch.bfloat16, device="meta")
    return _backward_high(sw.swiglu_backward_reference, gate_up, grad_h)[0] - gate_up.numel() * 2


def test_meta_backward_allocates_only_the_kernels_output():
    gate_up = torch.empty(3, 5, 2 * 96, dtype=torch.bfloat16, device="meta")
    grad_h = torch.empty(3, 5, 96, dtype=torch.bfloat16, device="meta")
    high, out = _backward_high(sw.swiglu_backward, gate_up, grad_h)
    assert out.shape == gate_up.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert high == gate_up.numel() * 2  # the output alone, as the kernel's torch.empty
    # the reference: fp32 copies of gate_up and dh, sigmoid and products, their concatenation (14 B an element)
    assert _fp32_excess(96, 15) == 14 * gate_up.numel()


def test_fake_tensors_take_the_kernel_on_cuda_and_the_profile_op_on_meta(monkeypatch):
    calls = []
    monkeypatch.setattr(sw, "_swiglu_backward_triton", lambda g, h: calls.append(g.device.type) or torch.empty_like(g))
    with FakeTensorMode():
        for device in ("cuda", "meta"):
            gate_up = torch.empty(4, 2 * 8, dtype=torch.bfloat16, device=device)
            out = sw.swiglu_backward(gate_up, torch.empty(4, 8, dtype=torch.bfloat16, device=device))
            assert out.shape == gate_up.shape and out.device.type == device
    assert calls == ["cuda"]  # a fake CUDA tensor's device.type is cuda (what torch.compile traces on a GPU)
    cpu = torch.randn(4, 16, dtype=torch.float64)
    dh = torch.randn(4, 8, dtype=torch.float64)
    assert torch.equal(sw.swiglu_backward(cpu, dh), sw.swiglu_backward_reference(cpu, dh))


def _block(fused: bool, **profile):
    cfg = titan_models.transforms.num_layers(1)(titan_models.flavor("llama3", "debug"))
    with torch.device("meta"):
        model = cfg.build()
    if fused:
        assert sw.use_fused_swiglu(model) == ["layers.0.feed_forward"]
    return profile_blocks(model, rows=ROWS, seq_len=SEQ, dtype=torch.bfloat16, **profile)[0], cfg


@pytest.mark.parametrize("reference", [False, True])
def test_fused_block_profiles_no_more_backward_than_the_plain_one(monkeypatch, reference):
    """Per option, the fused block's backward transient (high mark less what it saved) is within one bf16
    [tokens, ffn] of the plain block's (kept, the fused block saves no separate silu output, that much less, at
    the same high mark); with the old meta path (the torch reference) it exceeds it by more than half the fp32
    temporaries, 14 times as much."""
    plain, cfg = _block(False)
    if reference:  # what the meta profile ran before: gate_up.is_cuda False -> the fp32 reference
        monkeypatch.setattr(sw, "swiglu_backward", lambda g, h: sw.swiglu_backward_reference(g, h))
    fused, _ = _block(True)
    excess = _fp32_excess(cfg.ffn_dim, ROWS * SEQ)
    assert excess > 0
    for ops in OPTIONS.values():
        p, f = plain.held[ops], fused.held[ops]
        over = (f.backward_peak_bytes - f.saved_bytes) - (p.backward_peak_bytes - p.saved_bytes)
        if reference:
            assert over >= excess // 2, (ops, over, excess)
        else:
            assert over <= ROWS * SEQ * cfg.ffn_dim * 2, (ops, over, excess)
            assert f.forward_peak_bytes <= p.forward_peak_bytes  # the forward: silu and the product, as plain


def test_compiled_fused_block_saves_gate_up_as_the_kernel_needs():
    """Compiled on meta, the backward's opaque profile op keeps gate_up saved (the kernel reads it): a kept
    fused block saves what the plain one does, and what it saved with the reference path."""
    plain, _ = _block(False, compiled=True, only=(None,))
    fused, _ = _block(True, compiled=True, only=(None,))
    assert fused.held[None].saved_bytes == plain.held[None].saved_bytes > 0
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sw, "swiglu_backward", lambda g, h: sw.swiglu_backward_reference(g, h))
        old, _ = _block(True, compiled=True, only=(None,))
    assert fused.held[None].saved_bytes == old.held[None].saved_bytes
