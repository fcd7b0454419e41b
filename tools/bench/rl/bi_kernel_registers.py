"""Registers, spills and shared memory of titan-rl's batch-invariant Triton kernels for sm_90 (H100/H200),
compiled ahead of time on a machine without a GPU (Triton's bundled ptxas, `-v`).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/rl/bi_kernel_registers.py

One line per kernel and config: the matmul and attention tiles of tiles.py in float32 and bfloat16. A
float32 config that spills (ptxas "spill stores" > 0) runs its IEEE tl.dot (FMAs) from local memory.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from titan_rl.batch_invariant import triton_ops as T
from titan_rl.batch_invariant.tiles import attention_plan, matmul_plan

PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def ptxas_info(kernel, folder: Path) -> str:
    ptx = folder / "k.ptx"
    ptx.write_text(kernel.asm["ptx"])
    arch = re.search(r"\.target (\w+)", kernel.asm["ptx"]).group(1)
    result = subprocess.run([str(PTXAS), "-v", f"--gpu-name={arch}", str(ptx), "-o", str(folder / "k.cubin")],
                            capture_output=True, text=True, check=True)
    lines = [line.split("info    : ")[-1] for line in result.stderr.splitlines() if "spill" in line or "Used" in line]
    return f"shared {kernel.metadata.shared} B; " + "; ".join(lines)


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    signature = signature | {name: "constexpr" for name in constexprs}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def matmul_kernel(dtype: torch.dtype, n: int, k: int):
    plan, t = matmul_plan(n, k, dtype), TYPES[dtype]
    out = "fp32" if plan.splits > 1 else t
    signature = {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{out}"} | {a: "i32" for a in T._matmul_kernel.arg_names[3:14]}
    constexprs = {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "GROUP_M": T.MATMUL_GROUP_M,
                  "PRECISION": T._precision(dtype)}
    return plan, compile_sm90(T._matmul_kernel, signature, constexprs, plan.num_warps, plan.num_stages)


def attention_kernel(dtype: torch.dtype, head_dim: int = 64):
    plan, t, names = attention_plan(dtype), TYPES[dtype], T._attention_kernel.arg_names
    signature = {a: f"*{t}" for a in names[:4]} | {"pos_ptr": "*i32", "kvlen_ptr": "*i32", "sink_ptr": f"*{t}"}
    signature |= {a: ("fp32" if a == "scale" else "i32") for a in names[7:29]}
    constexprs = dict(D=head_dim, DV=head_dim, D_PAD=head_dim, DV_PAD=head_dim, BLOCK_M=plan.block_m,
                      BLOCK_N=plan.block_n, PRECISION=T._precision(dtype), HAS_SINKS=False)
    return plan, compile_sm90(T._attention_kernel, signature, constexprs, 4, 3)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in TYPES:
            plan, kernel = matmul_kernel(dtype, 8192, 2048)
            print(f"matmul {dtype} {plan}: {ptxas_info(kernel, Path(tmp))}", flush=True)
            plan, kernel = attention_kernel(dtype)
            print(f"attention {dtype} {plan}: {ptxas_info(kernel, Path(tmp))}", flush=True)


if __name__ == "__main__":
    main()
