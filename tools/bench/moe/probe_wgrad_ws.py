"""The weight gradient with Triton's warp specialization on Hopper, against the flattened kernel.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/moe/probe_wgrad_ws.py
    ... probe_wgrad_ws.py --compile-only   # no GPU: compile for sm_90, report whether the loop was specialized

Why: out[e] = P[rows of e]^T @ Q[rows of e] has 1,024 rows per expert at DeepSeek-V3's shapes, so a
128x256 tile is 16 steps of 64 rows and then a 64 KiB store that the flattened kernel's one group of
warps does not overlap with the next tile's multiplies (690 TFLOP/s against 750-770 for dh and dx).
Triton's automatic warp specialization for Hopper splits a loop marked `warp_specialize=True` into a
producer (the loads) and consumer warp groups; it needs the operands' descriptors made inside the
kernel and 4 warps a group (found compiling for sm_90 with triton 3.8, and 3.6 as on the device
image: with descriptors passed from the host it failed to compile at 4 warps; at 8 warps the loop
stays as it was). The kernel timed is dist-moe's weight_gemm_specialized_kernel (the plain nested
form: a tile loop over this program's tiles, a row loop over the tile's expert, TMA loads and
stores) in three tilings through dist-moe's launcher, and the same kernel with the flag off as the
control. Each variant is checked against float64, then all take turns being timed with the tuner's
first candidate (the "shipped" flattened kernel; medians), and each prints its speed as that
kernel's time over its own.
"""
from __future__ import annotations

import argparse
import os
import sys

import triton
from dist_moe.kernels.weight_gemm_specialized import weight_gemm_specialized_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


VARIANTS = {  # name: (BLOCK_K, BLOCK_N, BLOCK_R, GROUP_K, warps, stages, warp_specialize)
    "nested 128x256x64 w8 s3 (control)": (128, 256, 64, 8, 8, 3, False),
    "nested 128x256x64 w4 s3 warp-specialized": (128, 256, 64, 8, 4, 3, True),
    "nested 128x256x64 g32 w4 s3 warp-specialized": (128, 256, 64, 32, 4, 3, True),
    "nested 128x128x64 w4 s4 warp-specialized": (128, 128, 64, 8, 4, 4, True),
}


def launch(variant: tuple, p, q, ends, out) -> None:
    """A warp-specialized variant through dist-moe's launcher, as the layer would run it; the control
    (the flag off) straight to the kernel, since no launcher configuration runs it that way."""
    import torch
    from dist_moe.kernels.configs import WeightConfig
    from dist_moe.kernels.launch import weight_gemm

    bk, bn, br, group_k, warps, stages, ws = variant
    rows, kp = p.shape
    num_experts, _, nq = out.shape
    # Whole tiles: then the launcher takes the specialized kernel rather than falling back to the flattened one.
    assert kp % bk == 0 and nq % bn == 0, "the probe takes whole tiles only"
    if ws:
        config = WeightConfig(block_k=bk, block_n=bn, block_r=br, group_k=group_k, num_warps=warps,
                              num_stages=stages, persistent=True, store_tma=True, warp_specialize=True)
        weight_gemm(p=p, q=q, ends=ends, outs=(out,), padded=True, config=config)
        return
    tiles = num_experts * (kp // bk) * (nq // bn)
    sms = torch.cuda.get_device_properties(p.device).multi_processor_count
    weight_gemm_specialized_kernel[(min(tiles, sms),)](p, q, out, ends, rows, kp, nq, num_experts, kp, nq,
                                                       BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, GROUP_K=group_k,
                                                       WARP_SPECIALIZE=False, num_warps=warps, num_stages=stages)


def compile_only() -> int:
    """Compile each variant for sm_90 on any machine; print whether the loop was specialized."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"p_ptr": "*bf16", "q_ptr": "*bf16", "out_ptr": "*bf16", "ends_ptr": "*i32", "rows": "i32",
                 "KP": "i32", "NQ": "i32", "num_experts": "i32", "stride_pr": "i32", "stride_qr": "i32",
                 "BLOCK_K": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_R": "constexpr", "GROUP_K": "constexpr", "WARP_SPECIALIZE": "constexpr"}
    failures = 0
    for name, (bk, bn, br, group_k, warps, stages, ws) in VARIANTS.items():
        constexprs = {"BLOCK_K": bk, "BLOCK_N": bn, "BLOCK_R": br, "GROUP_K": group_k, "WARP_SPECIALIZE": ws}
        try:
            compiled = triton.compile(ASTSource(weight_gemm_specialized_kernel, signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages})
        except Exception as err:
            failures += 1
            print(f"FAIL {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        specialized = "ttg.warp_specialize" in compiled.asm["ttgir"]
        print(f"ok   {name:45s} smem {compiled.metadata.shared // 1024}K specialized: {specialized}", flush=True)
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true", help="no GPU: compile for sm_90 and report")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    print(f"triton {triton.__version__}", flush=True)
    if args.compile_only:
        return 1 if compile_only() else 0
    import torch

    from bench_setup import BF16_RTOL, Setup, rel_err
    from dist_moe.kernels.configs import weight_candidates
    from dist_moe.kernels.launch import TileMaps, _ensure_triton_allocator, gather_rows, weight_gemm

    setup = Setup(dry_run=False)
    # The control's in-kernel descriptors need Triton's allocator: the one the launcher sets for its own launches.
    _ensure_triton_allocator()
    gen = torch.Generator(device="cuda").manual_seed(1)
    d, f, e, dt = setup.hidden, setup.ffn, setup.experts, setup.dtype
    identity = torch.arange(setup.rows, device="cuda", dtype=torch.int32)
    shipped = weight_candidates(torch.device("cuda"), dt, tma=True)[0]
    for routing in ("uniform", "skewed"):
        counts = setup.counts(routing)
        maps = TileMaps(setup.offsets(counts), setup.rows)
        ends = maps.padded_ends()
        for shape, (kp, nq) in {"w2": (d, f), "w13 (one output)": (2 * f, d)}.items():
            p_rows = torch.randn(setup.rows, kp, generator=gen, device="cuda").to(dt)
            q_rows = torch.randn(setup.rows, nq, generator=gen, device="cuda").to(dt)
            p, q = gather_rows(p_rows, identity, 1, maps), gather_rows(q_rows, identity, 1, maps)
            want, start = torch.empty(e, kp, nq, dtype=torch.float64, device="cuda"), 0
            for i, c in enumerate(counts):
                want[i] = p_rows[start:start + c].double().T @ q_rows[start:start + c].double()
                start += c
            fns = {}
            shipped_out = torch.empty(e, kp, nq, device="cuda", dtype=dt)
            fns[f"shipped {shipped.name()}"] = (lambda: weight_gemm(p=p, q=q, ends=ends, outs=(shipped_out,),
                                                                    padded=True, config=shipped), shipped_out)
            for name, variant in VARIANTS.items():
                out = torch.empty(e, kp, nq, device="cuda", dtype=dt)
                fns[name] = (lambda variant=variant, out=out: launch(variant, p, q, ends, out), out)
            ok = {}
            for name, (fn, out) in fns.items():
                try:
                    fn()
                    err = rel_err(out, want)
                    print(f"[{shape} {routing}] {name:45s} err {err:.1e}", flush=True)
                    if err <= BF16_RTOL:
                        ok[name] = fn
                except Exception as exc:
                    print(f"[{shape} {routing}] {name:45s} failed: {type(exc).__name__}: {str(exc)[:160]}")
            flops = 2.0 * setup.rows * kp * nq
            times = setup.interleaved_ms(ok, rounds=args.rounds, per_block=10)
            anchor = times.get(f"shipped {shipped.name()}")  # the ratio: the shipped kernel's time over this one's
            for name, ms in times.items():
                speed = f"x{anchor / ms:.3f} the shipped" if anchor else "(the shipped kernel failed its check)"
                print(f"[{shape} {routing}] {name:45s} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s {speed}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
