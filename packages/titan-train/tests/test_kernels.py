"""titan-train's Triton kernels (kernels/): on CPU through TRITON_INTERPRET=1 against float64, the swiglu
autograd function and the FeedForward swap on CPU, and on a GPU in bf16 plus a compiled bf16 training
run with the kernels on against the same run with them off."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import titan_models as tm
from titan_train import train
from titan_train.kernels.swiglu import FusedSwiGLUFeedForward, swiglu, swiglu_backward, use_fused_swiglu

CHECKS = [*(f"swiglu_backward_{s}" for s in ("7x1500", "4x1024")),
          *(f"cross_entropy_{what}_{s}" for s in ("5x9000", "3x4096") for what in ("loss", "grad")),
          *(f"adamw_{what}_2500" for what in ("master", "exp_avg", "exp_avg_sq", "param")),
          *(f"adamw_bf16_moments_{what}_2500" for what in ("master", "exp_avg", "exp_avg_sq"))]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_checks.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_interpreted_check_ran(interpreted):
    assert sorted(interpreted) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_interpreted_kernel_matches_float64(interpreted, name):
    assert interpreted[name]["ok"], interpreted[name]


def test_swiglu_function_matches_autograd_in_float64():
    gate_up = torch.randn(3, 5, 2 * 6, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 5, 6, dtype=torch.float64)
    swiglu(gate_up).backward(grad)
    leaf = gate_up.detach().clone().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad)
    torch.testing.assert_close(gate_up.grad, leaf.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.randn(2, 5))


def test_fused_feed_forward_is_the_same_module_with_the_same_outputs():
    torch.manual_seed(0)
    config = tm.flavor("llama3", "debug")
    model = config.build()
    model.init_weights(seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    before = model(tokens)
    names_before = dict(model.state_dict())
    swapped = use_fused_swiglu(model)
    assert swapped and all(type(model.get_submodule(n)) is FusedSwiGLUFeedForward for n in swapped)
    after_state = model.state_dict()
    assert list(after_state) == list(names_before)
    assert all(after_state[k] is names_before[k] or after_state[k].data_ptr() == names_before[k].data_ptr()
               for k in after_state)  # the same tensors: nothing was copied
    torch.testing.assert_close(model(tokens), before, rtol=1e-6, atol=1e-6)


def test_a_clamped_swiglu_feed_forward_keeps_its_own_activation():
    """The fused SwiGLU computes silu(gate) * up only: a FeedForward with another activation (DeepSeek-V4's
    clamped shared expert) is left as it is, so its outputs do not change."""
    from titan_models.components.ffn import ClampedSwiGLU, FeedForward

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"plain": FeedForward(16, 32),
                                 "clamped": FeedForward(16, 32, activation=ClampedSwiGLU(limit=0.5))})
    x = torch.randn(3, 16) * 4
    before = model["clamped"](x)
    assert use_fused_swiglu(model) == ["plain"]
    assert type(model["clamped"]) is FeedForward
    torch.testing.assert_close(model["clamped"](x), before, rtol=0, atol=0)
    # the control: the fused forward would have ignored the clamp
    fused = FusedSwiGLUFeedForward.__new__(FusedSwiGLUFeedForward)
    fused.__dict__ = dict(model["clamped"].__dict__)
    assert not torch.allclose(fused(x), before, atol=1e-3)


@needs_gpu
@pytest.mark.parametrize("rows,width", [(4096, 8192), (1000, 1408)])
def test_swiglu_backward_kernel_bf16(rows, width):
    gate_up = (torch.randn(rows, 2 * width, device="cuda") * 2).bfloat16()
    grad_h = torch.randn(rows, width, device="cuda").bfloat16()
    want = swiglu_backward(gate_up.double(), grad_h.double(), use_triton=False)
    got = swiglu_backward(gate_up, grad_h)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 8e-3, err  # bf16 output rounding


@needs_gpu
def test_cross_entropy_kernel_bf16():
    from titan_train.kernels.cross_entropy import cross_entropy_chunk_triton

    logits = (torch.randn(2048, 128256, device="cuda") * 3).bfloat16()
    target = torch.randint(0, 128256, (2048,), device="cuda")
    valid = torch.rand(2048, device="cuda") > 0.1
    ref = logits.double().requires_grad_()
    want = F.cross_entropy(ref, torch.where(valid, target, -100), ignore_index=-100, reduction="sum")
    want.backward()
    loss, grad = cross_entropy_chunk_triton(logits, torch.where(valid, target, 0), valid)
    assert grad.data_ptr() == logits.data_ptr()  # written over the logits
    assert abs(loss.item() - want.item()) / want.item() < 1e-5
    err = ((grad.double() - ref.grad).norm() / ref.grad.norm()).item()
    assert err < 8e-3, err


@needs_gpu
def test_compiled_bf16_training_with_the_kernels_follows_the_run_without(tmp_path, jobs):
    from torch._dynamo.utils import counters

    common = {"job.device": "cuda", "training.steps": "12", "training.seq_len": "256", "training.batch_size": "8",
              "model.num_layers": "4", "training.mixed_precision": "bf16", "compile.enabled": "true"}
    plain = train(jobs.tiny(tmp_path / "plain", **common, **{"training.fused_kernels": "false"})).losses
    counters.clear()
    fused = train(jobs.tiny(tmp_path / "fused", **common, **{"training.fused_kernels": "true"})).losses
    assert not counters["graph_break"], dict(counters["graph_break"])  # the swiglu function compiles in the block
    assert fused[12] < fused[1] - 1.0
    for step in plain:  # bf16: the two orders of rounding agree to a few percent per step
        assert fused[step] == pytest.approx(plain[step], rel=3e-2)
