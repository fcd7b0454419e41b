"""GPU kernels of flexshard against their floors, measured in the same run (one GPU).

  blockwise fp8 quantize (what each rank does before the packed all-gather), three ways:
    torch eager (flexshard.quantize_blockwise), torch.compile of it, and a one-pass Triton kernel;
    floor = bytes moved (read bf16, write e4m3 + one fp32 scale per tile) / copy bandwidth.
  Newton–Schulz (5 quintic steps, bf16, what Muon runs per matrix):
    floor = matmul FLOPs / bf16 GEMM rate.
Self-checking: eager quantize must stay within the e4m3 error bound of a float64 reference, and each
other quantizer is compared with it bit for bit (a mismatch is printed and marked in the table);
Newton–Schulz in bf16 must stay close to float64.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/flexshard/kernels_gpu.py
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    import flexshard
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "flexshard" / "src"))
    import flexshard
from flexshard.optim import newton_schulz, newton_schulz_flops

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths still run
    triton = None

if triton is not None:

    @triton.jit
    def _quantize_tiles(x_ptr, q_ptr, s_ptr, rows, cols, n_tile_cols, BR: tl.constexpr, BC: tl.constexpr):
        """One program per (BR, BC) tile: amax, scale = amax / 448, q = e4m3(clamp(x / scale))."""
        ti, tj = tl.program_id(0), tl.program_id(1)
        r = ti * BR + tl.arange(0, BR)[:, None]
        c = tj * BC + tl.arange(0, BC)[None, :]
        mask = (r < rows) & (c < cols)
        x = tl.load(x_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        # Correctly rounded divisions, as torch's tensor / tensor, so the bits agree.
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptr + r * cols + c, y.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + ti * n_tile_cols + tj, scale)

    def quantize_triton(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        nr, nc = triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1])
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(nr, nc, dtype=torch.float32, device=x.device)
        _quantize_tiles[(nr, nc)](x.contiguous(), q, s, rows, cols, nc, BR=block[0], BC=block[1], num_warps=8)
        return q, s


def bench(fn, *, iters: int = 20) -> float:
    """Median seconds per call (CUDA events, after warm-up; a wall clock on CPU dry runs)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device) -> float:
    x = torch.empty(2**30 if device.type == "cuda" else 2**24, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x))  # read + write


def gemm_rate(device, n: int = 8192) -> float:
    n = n if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / bench(lambda: a @ b, iters=10)


def bit_exact(name, fn, x, block, ref_q, ref_s) -> bool:
    q, s = fn(x, block)
    if torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s):
        return True
    bad = (q.view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()
    print(f"MISMATCH {name}: {bad} e4m3 bytes differ from flexshard.quantize_blockwise, scales equal: {torch.equal(s, ref_s)}")
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128))
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only for a dry run of the script itself")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kernels_gpu.py needs a CUDA GPU (or --device cpu for a dry run)")
    block = tuple(args.block)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU dry run"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__ if triton else 'absent'}")
    bw, rate = copy_bandwidth(device), gemm_rate(device)
    print(f"measured: copy bandwidth {bw / 1e9:.0f} GB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")

    # ---- correctness: quantize ----
    torch.manual_seed(0)
    small = (torch.randn(1000, 1100, device=device) * torch.logspace(-3, 3, 1100, device=device)).bfloat16()
    q, s = flexshard.quantize_blockwise(small, block)
    back = flexshard.dequantize_blockwise(q, s, block, torch.float64)
    x64 = small.double()
    scale_of = s.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: small.shape[0], : small.shape[1]]
    assert ((back - x64).abs() <= x64.abs() * 2**-4 + scale_of * 2**-10).all(), "e4m3 error bound vs float64 violated"
    quantizers = {"torch eager": flexshard.quantize_blockwise, "torch.compile": torch.compile(flexshard.quantize_blockwise, dynamic=False)}
    if triton is not None and all(b & (b - 1) == 0 for b in block):  # tl.arange needs powers of two
        quantizers["triton (one pass)"] = quantize_triton
    x = torch.randn(args.rows, args.cols, device=device).bfloat16()
    ref_q, ref_s = flexshard.quantize_blockwise(x, block)
    exact = {
        name: bit_exact(name, fn, small, block, q, s) and bit_exact(name, fn, x, block, ref_q, ref_s)
        for name, fn in quantizers.items()
    }

    # ---- correctness: Newton–Schulz ----
    g = torch.randn(1024, 2048, device=device)
    want = newton_schulz(g.double(), dtype=torch.float64)
    err = (newton_schulz(g, dtype=torch.bfloat16).double() - want).abs().max().item()
    assert err < 0.05, f"bf16 Newton–Schulz off float64 by {err}"
    print(f"correct: eager quantize within the e4m3 bound of float64; NS bf16 vs float64 max error {err:.3g}")

    rows = []
    tiles = ref_s.numel()
    q_bytes = x.numel() * 2 + x.numel() + 4 * tiles
    for name, fn in quantizers.items():
        t = bench(lambda: fn(x, block))
        label = f"quantize {name}" + ("" if exact[name] else " (NOT bit-exact)")
        rows.append((label, f"{args.rows}x{args.cols} bf16, {block[0]}x{block[1]} tiles", t, q_bytes / bw, "memory"))
    shapes = ((4096, 4096), (4096, 14336), (8, 1408, 2048)) if device.type == "cuda" else ((64, 96),)
    for shape in shapes:
        m = torch.randn(shape, device=device)
        t = bench(lambda: newton_schulz(m, dtype=torch.bfloat16), iters=10)
        rows.append(("newton_schulz bf16", "x".join(map(str, shape)), t, newton_schulz_flops(shape) / rate, "compute"))
    print(f"{'kernel':<44} {'shape':<34} {'time us':>9} {'floor us':>9} {'of floor':>9}  bound")
    for name, shape, t, floor, bound in rows:
        print(f"{name:<44} {shape:<34} {t * 1e6:>9.1f} {floor * 1e6:>9.1f} {floor / t:>8.0%}  {bound}")


if __name__ == "__main__":
    main()
