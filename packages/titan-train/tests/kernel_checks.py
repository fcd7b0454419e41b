"""titan-train's Triton kernels under TRITON_INTERPRET=1 (CPU, float32) against float64 references.

Run by test_kernels.py in a subprocess (the interpreter must be chosen before triton is imported);
prints one JSON object {check name: {"ok", "err", "scale"}}. Shapes are small and not multiples of
the kernels' tiles, so every mask is exercised; the loss has ignored rows; AdamW is checked against its
formula in float64.
"""
from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from titan_train.kernels.adamw import adamw_master_step  # noqa: E402
from titan_train.kernels.cross_entropy import cross_entropy_chunk_triton  # noqa: E402
from titan_train.kernels.swiglu import swiglu_backward  # noqa: E402

TOL = 1e-5  # float32 kernels against float64, relative to the reference's largest entry
results: dict[str, dict] = {}


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    results[name] = {"ok": bool(err <= TOL * scale) and got.shape == want.shape, "err": err, "scale": scale}


def swiglu_checks(rows: int, width: int) -> None:
    gate_up = torch.randn(rows, 2 * width, dtype=torch.float64) * 3
    grad_h = torch.randn(rows, width, dtype=torch.float64)
    leaf = gate_up.clone().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad_h)
    got = swiglu_backward(gate_up.float(), grad_h.float(), use_triton=True)
    check(f"swiglu_backward_{rows}x{width}", got, leaf.grad)


def cross_entropy_checks(rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab, dtype=torch.float64) * 4
    target = torch.randint(vocab, (rows,))
    valid = torch.rand(rows) > 0.3
    valid[0], valid[-1] = True, False
    leaf = logits.clone().requires_grad_()
    want_loss = F.cross_entropy(leaf, torch.where(valid, target, -100), ignore_index=-100, reduction="sum")
    want_loss.backward()
    got_loss, got_grad = cross_entropy_chunk_triton(logits.float(), torch.where(valid, target, 0), valid)
    check(f"cross_entropy_loss_{rows}x{vocab}", got_loss.reshape(1), want_loss.detach().reshape(1))
    check(f"cross_entropy_grad_{rows}x{vocab}", got_grad, leaf.grad)


def adamw_checks(numel: int) -> None:
    hp = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    master = torch.randn(numel, dtype=torch.float64)
    exp_avg, exp_avg_sq = torch.randn(numel, dtype=torch.float64) * 0.1, torch.rand(numel, dtype=torch.float64) * 0.01
    grad = torch.randn(numel, dtype=torch.float64)
    state = [t.float() for t in (master, exp_avg, exp_avg_sq)]
    param = torch.empty(numel)
    adamw_master_step(param, grad.float(), *state, step=3, **hp, use_triton=True, block=1024)
    want_m = exp_avg + (1 - hp["beta1"]) * (grad - exp_avg)
    want_v = hp["beta2"] * exp_avg_sq + (1 - hp["beta2"]) * grad * grad
    denom = want_v.sqrt() / (1 - hp["beta2"] ** 3) ** 0.5 + hp["eps"]
    want_w = master * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] / (1 - hp["beta1"] ** 3) * want_m / denom
    check(f"adamw_master_{numel}", state[0], want_w)
    check(f"adamw_exp_avg_{numel}", state[1], want_m)
    check(f"adamw_exp_avg_sq_{numel}", state[2], want_v)
    check(f"adamw_param_{numel}", param, want_w)


def adamw_bf16_moment_checks(numel: int) -> None:
    """bf16 moments: updated in fp32 from their bf16 values, the master's update from the unrounded new moments
    (float64 reference), the moments stored in bf16."""
    hp = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    master = torch.randn(numel, dtype=torch.float64)
    exp_avg = (torch.randn(numel, dtype=torch.float64) * 0.1).bfloat16()
    exp_avg_sq = (torch.rand(numel, dtype=torch.float64) * 0.01).bfloat16()
    grad = torch.randn(numel, dtype=torch.float64)
    state = [master.float(), exp_avg.clone(), exp_avg_sq.clone()]
    param = torch.empty(numel)
    adamw_master_step(param, grad.float(), *state, step=3, **hp, use_triton=True, block=1024)
    m0, v0, g = exp_avg.double(), exp_avg_sq.double(), grad.float().double()
    want_m = m0 + (1 - hp["beta1"]) * (g - m0)
    want_v = hp["beta2"] * v0 + (1 - hp["beta2"]) * g * g
    denom = want_v.sqrt() / (1 - hp["beta2"] ** 3) ** 0.5 + hp["eps"]
    want_w = master * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] / (1 - hp["beta1"] ** 3) * want_m / denom
    check(f"adamw_bf16_moments_master_{numel}", state[0], want_w)
    for name, got, want in (("exp_avg", state[1], want_m), ("exp_avg_sq", state[2], want_v)):
        # Within one bf16 step of float64: Triton's interpreter truncates every fp32 -> bf16 cast whatever the
        # rounding mode asked for, so rounding to nearest even is checked on the GPU (test_master_adamw.py).
        far = ((got.double() - want).abs() > want.abs() * 2**-7).sum().item()
        results[f"adamw_bf16_moments_{name}_{numel}"] = {"ok": got.dtype == torch.bfloat16 and far == 0,
                                                          "err": far, "scale": numel}


if __name__ == "__main__":
    torch.manual_seed(0)
    swiglu_checks(7, 1500)  # 2 row tiles (one partial), 2 column tiles (one partial)
    swiglu_checks(4, 1024)  # exact tiles
    cross_entropy_checks(5, 9000)  # 3 blocks of 4096, the last partial
    cross_entropy_checks(3, 4096)  # exactly one block
    adamw_checks(2500)  # 3 blocks of 1024, the last partial
    adamw_bf16_moment_checks(2500)
    print(json.dumps(results))
