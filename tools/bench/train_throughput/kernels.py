"""titan-train's Triton kernels against their memory floor and against torch.compile's code for the same step.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/train_throughput/kernels.py

Shapes are the 1.5B Llama's of bench.py (batch 4 x 4096 = 16,384 tokens, FFN 8192, vocabulary 128,256,
loss chunk 8192 tokens, AdamW over 256M parameters, the size of its embedding), bf16. The floor is the bytes a kernel must move (each input read once, each
output written once) over the device copy bandwidth measured in the same run; the anchor is the same
function compiled by torch.compile (what titan-train runs with training.fused_kernels false), and for
AdamW torch's fused AdamW on fp32 parameters (what the autocast mode runs). Every variant is checked
against a float64 reference (AdamW: against torch ops on the same fp32 state) before it is timed.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from titan_train.kernels.adamw import adamw_master_step
from titan_train.kernels.cross_entropy import cross_entropy_chunk_triton
from titan_train.kernels.swiglu import swiglu_backward, swiglu_backward_reference
from titan_train.loss import _chunk_loss_and_grad_fusable


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def row(name: str, seconds: float, floor: float, anchor: float, err: float) -> str:
    return f"{name:<44}{seconds * 1e6:9.0f}{floor * 1e6:9.0f}{floor / seconds:9.0%}{anchor / seconds:8.2f}x{err:10.1e}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--adamw-numel", type=int, default=256 * 2**20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 2 / bench(lambda: dst.copy_(src))
    del src, dst
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; device copy {copy / 1e9:.0f} GB/s")
    print(f"{'kernel':<44}{'us':>9}{'floor':>9}{'of floor':>9}{'vs anchor':>9}{'rel err':>10}")

    # SwiGLU backward: read gate_up [M, 2F] and dh [M, F], write d gate_up [M, 2F].
    m, f = args.tokens, args.ffn
    gate_up = torch.randn(m, 2 * f, device="cuda").bfloat16()
    dh = torch.randn(m, f, device="cuda").bfloat16()
    want = swiglu_backward_reference(gate_up[:1024].double(), dh[:1024].double())
    floor = 10 * m * f / copy
    compiled = torch.compile(swiglu_backward_reference)
    anchor = bench(lambda: compiled(gate_up, dh))
    print(row(f"swiglu backward {m}x{f}, torch.compile", anchor, floor, anchor, rel_err(compiled(gate_up, dh)[:1024], want)))
    seconds = bench(lambda: swiglu_backward(gate_up, dh))
    print(row(f"swiglu backward {m}x{f}, Triton", seconds, floor, anchor, rel_err(swiglu_backward(gate_up, dh)[:1024], want)))
    del gate_up, dh, compiled

    # Loss chunk: read logits [C, V] once, write the gradient once (the kernel re-reads each row).
    c, v = args.chunk, args.vocab
    logits = (torch.randn(c, v, device="cuda") * 3).bfloat16()
    target = torch.randint(0, v, (c,), device="cuda")
    valid = torch.rand(c, device="cuda") > 0.05
    ref = logits[:256].double().requires_grad_()
    F.cross_entropy(ref, torch.where(valid[:256], target[:256], -100), ignore_index=-100, reduction="sum").backward()
    floor = 2 * c * v * 2 / copy
    compiled = torch.compile(_chunk_loss_and_grad_fusable, dynamic=False)
    anchor = bench(lambda: compiled(logits, target, valid, acc=torch.float32))
    print(row(f"loss chunk {c}x{v}, torch.compile", anchor, floor, anchor,
              rel_err(compiled(logits, target, valid, acc=torch.float32)[1][:256], ref.grad)))
    work = logits.clone()
    for block, warps in ((2048, 8), (4096, 8), (4096, 16), (8192, 16), (8192, 32), (16384, 32)):
        work.copy_(logits)
        grad = cross_entropy_chunk_triton(work, target, valid, block=block, num_warps=warps)[1]
        err = rel_err(grad[:256], ref.grad)
        seconds = bench(lambda: cross_entropy_chunk_triton(work, target, valid, block=block, num_warps=warps))
        print(row(f"loss chunk {c}x{v}, Triton block {block} warps {warps}", seconds, floor, anchor, err))
    del logits, work, compiled

    # AdamW on n parameters: bf16 param + grad with fp32 master and moments (read 14 B, write 14 B), against
    # torch's fused AdamW on fp32 parameters and gradients (read 16 B, write 12 B): the same 28 B floor.
    n = args.adamw_numel
    hp = {"lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    floor = 28 * n / copy
    p32 = torch.nn.Parameter(torch.randn(n, device="cuda"))
    p32.grad = torch.randn(n, device="cuda")
    fused = torch.optim.AdamW([p32], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                              weight_decay=hp["weight_decay"], fused=True)
    anchor = bench(fused.step)
    print(row(f"AdamW {n / 1e6:.0f}M params, torch fused (fp32)", anchor, floor, anchor, 0.0))
    del p32, fused
    master = torch.randn(n, device="cuda")
    moments = [torch.randn(n, device="cuda") * 0.1, torch.rand(n, device="cuda") * 1e-3]
    grad = torch.randn(n, device="cuda").bfloat16()
    param = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    check = [master[:4096].clone(), moments[0][:4096].clone(), moments[1][:4096].clone()]
    adamw_master_step(param[:4096], grad[:4096], *check, step=7, **hp, use_triton=False)
    trial = [master[:4096].clone(), moments[0][:4096].clone(), moments[1][:4096].clone()]
    adamw_master_step(param[:4096], grad[:4096], *trial, step=7, **hp)
    err = rel_err(trial[0], check[0].double())
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
        seconds = bench(lambda: adamw_master_step(param, grad, master, *moments, step=7, **hp, block=block,
                                                  num_warps=warps))
        print(row(f"AdamW {n / 1e6:.0f}M, bf16 + fp32 master, Triton {block}/{warps}", seconds, floor, anchor, err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
