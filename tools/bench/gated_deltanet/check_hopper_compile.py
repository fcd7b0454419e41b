"""Compile titan-models' Triton delta-rule kernels for Hopper (sm_90) without a GPU, and check them.

Every launch of one forward and one backward at Qwen3.5's linear-attention head shapes (key and value
dims 128; bfloat16 and float32 inputs, with and without packed documents and an initial state) is
captured, not run, then compiled ahead of time with the installed triton and its bundled ptxas for each
warps/stages configuration the autotuner tries (dist_moe.kernels.hopper_check does the compiling and
the checks: builds, shared memory fits; register spills are printed). Tensor-core use (wgmma) is
expected in every variant (bf16 products in the forward and tf32 in the backward for bf16 inputs, tf32x3
for float32 ones). Exits 1 if any
variant fails to build, or if no config of a launch fits shared memory; a config that does not fit is
printed as "skip" (the autotuner times it as infinitely slow and keeps another: triton's Autotuner._bench
catches OutOfResources).

    uv run --frozen --no-sync python tools/bench/gated_deltanet/check_hopper_compile.py [KERNEL ...]
"""
from __future__ import annotations

import sys

import torch

from dist_moe.kernels.hopper_check import HOPPER, inspect_compiled, specialise  # noqa: F401
from titan_models.kernels import gated_delta_rule as wrapper
from titan_models.kernels import gated_delta_rule_kernels as kern
from titan_models.kernels import qk_l2_norm as norm

NORM_KERNELS = ("l2_norm_kernel", "l2_norm_backward_kernel")  # kernels/qk_l2_norm.py, one launch config
KERNELS = ("gates_kernel", "prepare_kernel", "state_forward_kernel", "output_kernel", "output_backward_kernel", "state_backward_kernel",
           "chunk_pairs_backward_kernel", "chunk_qk_backward_kernel")


def captured_launches() -> list:
    seen = []

    class Recorder:
        def __init__(self, tuned):
            self.tuned = tuned

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.tuned, args, kwargs))

    saved = {name: getattr(kern, name) for name in KERNELS}
    saved_norm = {name: getattr(norm, name) for name in NORM_KERNELS}
    for name in KERNELS:
        setattr(kern, name, Recorder(saved[name]))
    for name in NORM_KERNELS:
        setattr(norm, name, Recorder(saved_norm[name]))
    try:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.zeros(1, 200, 2, 128, dtype=dtype)
            norm.l2_norm_qk(x, x, dtype)
            norm.l2_norm_qk_backward(x, x, x.float(), x.float())
        for dtype in (torch.bfloat16, torch.float32):
            for packed in (False, True):
                b, s, h, d = 1, 200, 2, 128
                q, k, v = (torch.zeros(b, s, h, d, dtype=dtype) for _ in range(3))
                g, beta = torch.zeros(b, s, h), torch.zeros(b, s, h)
                seg = torch.zeros(b, s, dtype=torch.int64) if packed else None
                init = torch.zeros(b, h, d, d) if packed else None
                inputs = wrapper._Inputs(q, k, v, g, beta, seg, init)
                inputs.forward(with_output=True)
                for block in (32, 16):  # the scan's block where B*H*V/64 leaves SMs idle; bench --scan-bv 16
                    inputs._scan_block = lambda block=block: block
                    inputs.forward(with_output=True)
                del inputs._scan_block
                inputs.backward(torch.zeros(b, s, h, d), torch.zeros(b, h, d, d) if packed else None)
    finally:
        for name, tuned in saved.items():
            setattr(kern, name, tuned)
        for name, kernel in saved_norm.items():
            setattr(norm, name, kernel)
    return seen


def launch_configs(kernel, kwargs) -> list:
    """The autotuner's configs, or the one config an untuned kernel is launched with."""
    import triton

    return getattr(kernel, "configs", None) or [triton.Config({}, num_warps=kwargs.get("num_warps", 4),
                                                              num_stages=kwargs.get("num_stages", 3))]


def main(only: list[str]) -> int:
    """only: kernel names to compile (all when empty)."""
    import triton
    from triton.compiler import ASTSource

    failures, done, fitting = 0, set(), {}
    for tuned, args, kwargs in captured_launches():
        fn = tuned.fn if hasattr(tuned, "configs") else tuned  # an Autotuner wraps the JITFunction
        if only and fn.__name__ not in only:
            continue
        for config in launch_configs(tuned, kwargs):
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            signature, constexprs, attrs, _ = specialise(fn, args, kwargs)
            launch = (fn.__name__, tuple(sorted(signature.items())), str(sorted(constexprs.items())))
            key = (*launch, tuple(options.items()))
            fitting.setdefault(launch, False)
            if key in done:
                continue
            done.add(key)
            try:
                compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                                          target=HOPPER, options=options)
            except Exception as err:  # report every variant, not just the first failure
                failures += 1
                print(f"FAIL {fn.__name__} {options}: {type(err).__name__}: {str(err)[:400]}")
                continue
            info = inspect_compiled(compiled)
            bad = info["shared"] > 232448
            fitting[launch] |= not bad
            print(f"{'skip' if bad else 'ok  '} {fn.__name__:27s} PREC={constexprs.get('PREC')} "
                  f"OPS={constexprs.get('OPS')} BV={constexprs.get('BV')} "
                  f"SEG={constexprs.get('HAS_SEG')} {options} smem {info['shared'] // 1024}K regs "
                  f"{info['registers']} spills {info['spill_bytes']} wgmma {info['wgmma']}", flush=True)
    for (name, _, constexprs), fits in fitting.items():
        if not fits:
            failures += 1
            print(f"FAIL {name} {constexprs[:300]}: no config fits shared memory")
    print(f"{len(done)} variants, {failures} failing, {sum(not fits for fits in fitting.values())} launches "
          f"without a fitting config")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
