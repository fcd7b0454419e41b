"""Compile dist-moe's Triton kernels for Hopper (sm_90) on a machine without a GPU, and check them.

    python -m dist_moe.kernels.hopper_check [--quick]

(tools/bench/moe/check_hopper_compile.py adds the benchmark's sweep configurations.)

Every kernel launch of a MoE layer's forward and backward, and of grouped_mm, is captured at
DeepSeek-V3 widths (hidden 7168, expert width 2048; few experts and rows, which do not change the
compiled code) with every Hopper candidate configuration, then compiled ahead of time with the
installed triton and its bundled ptxas for sm_90. Each compiled variant must: build, use wgmma,
pipeline its main loop (cp.async or TMA copies), fit the 227 KiB of shared memory and spill at
most 64 bytes of registers per thread (ptxas -v on the PTX); the warp-specialized weight gradient
(weight_gemm_specialized.py, the third padded-layout candidate) must also come out split into warp
groups. Prints one line per variant; exits 1 if any fails.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

try:
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # older triton: no AOT specialisation helper
    native_specialize_impl = None

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes per block on H100/H200 (227 KiB)
SM_SHARED = 233472  # bytes per SM (228 KiB)
SM_REGISTERS = 65536
MEMORY_BOUND = ("tile_map_kernel", "gather_rows_kernel", "swiglu_backward_kernel", "invert_slots_kernel",
                "slot_sum_kernel", "tile_amax_kernel", "quantize_tiles_kernel")  # no GEMM: no wgmma expected
SPILL_LIMIT = 64  # bytes per thread of register spills tolerated (a warning below it)


def specialise(kernel, args: tuple, kwargs: dict):
    """Signature, constexprs and divisibility attributes as the JIT would derive them."""
    names = kernel.arg_names
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        param = kernel.params[i]
        value = bound[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = value
        if isinstance(key, str) and "D" in key:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def inspect_compiled(compiled) -> dict:
    ptx = compiled.asm["ptx"]
    # The box of each TMA descriptor as compiled: rows wider than the 128-byte swizzle are split
    # into several copies by the compiler (the host descriptor gets this box).
    boxes = [tuple(m["block_size"]) for m in (getattr(compiled.metadata, "tensordesc_meta", None) or [])
             if isinstance(m, dict) and "block_size" in m]
    return {
        "boxes": boxes,
        "shared": compiled.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "specialized": "ttg.warp_specialize" in compiled.asm.get("ttgir", ""),
        **register_use(ptx),
    }


def register_use(ptx: str) -> dict:
    """Registers per thread and spilled bytes, from the bundled ptxas (-v) on the PTX."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return {"registers": None, "spill_bytes": None}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True)
    log = result.stdout + result.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", log)]
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills) if spills else None}


@contextmanager
def capture_launches(launch_module):
    """Replace the kernels the launcher calls with recorders of (kernel, args, kwargs)."""
    seen = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.kernel, args, kwargs))

    names = ("row_gemm_kernel", "weight_gemm_kernel", "weight_gemm_specialized_kernel", "tile_map_kernel",
             "gather_rows_kernel", "swiglu_backward_kernel", "invert_slots_kernel", "slot_sum_kernel")
    saved = {n: getattr(launch_module, n) for n in names}
    for n in names:
        setattr(launch_module, n, Recorder(saved[n]))
    try:
        yield seen
    finally:
        for n, k in saved.items():
            setattr(launch_module, n, k)


def layer_launches(quick: bool):
    """Launches of one MoE layer forward+backward and one grouped_mm forward+backward, once per
    candidate index (every Hopper candidate of every kernel role appears; --quick: the first)."""
    import dist_moe.kernels.configs as configs

    row_lists = {role: _hopper_rows(configs, role) for role in configs.ROLES}
    weight_lists = {tma: _hopper_weights(configs, tma) for tma in (False, True)}
    depth = 1 if quick else max(len(v) for v in [*row_lists.values(), *weight_lists.values()])
    all_launches = []
    for index in range(depth):
        def rows(role, device, dtype=None, index=index):
            options = row_lists[role]
            return [options[min(index, len(options) - 1)]]

        def weights_of(device, dtype=None, *, tma=False, index=index):
            options = weight_lists[tma]
            return [options[min(index, len(options) - 1)]]

        all_launches.extend(capture_layer(rows, weights_of))  # the warp-specialized weight gradient included
    return all_launches


def capture_layer(rows, weights_of) -> list:
    """The launches (recorded, not run) of a MoE layer forward+backward and a grouped_mm
    forward+backward at DeepSeek-V3 widths (few experts and rows: they do not change the compiled
    code), with `rows(role, device, dtype)` and `weights_of(device, dtype, tma=)` as the candidate lists."""
    import dist_moe
    import dist_moe.kernels.configs as configs
    import dist_moe.kernels.launch as launch

    dim, ffn, experts, tokens, top_k = 7168, 2048, 4, 64, 2
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(tokens, dim, generator=gen).to(bf)
    w1, w3 = (torch.randn(experts, ffn, dim, generator=gen).to(bf) for _ in range(2))
    w2 = torch.randn(experts, dim, ffn, generator=gen).to(bf)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    sent = dist_moe.dispatch(x, ids, weights, num_experts=experts)
    grad = torch.randn(tokens, dim, generator=gen).to(bf)

    old = (launch.row_candidates, launch.weight_candidates)
    launch.row_candidates, launch.weight_candidates = rows, weights_of
    configs._chosen.clear()
    try:
        with capture_launches(launch) as seen, _pretend_triton_on_cpu():
            for keep in (False, True):  # the gate/up GEMM's two roles: gathering A ("dual") or TMA ("dual_tma")
                xs = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
                wt = weights.clone().requires_grad_()
                out = dist_moe.expert_mlp(*xs, sent.offsets, sent.row_slot, top_k=top_k, weights=wt, backend="triton",
                                          keep_routed_input=keep)
                out.backward(grad)
            xg = torch.randn(tokens * top_k, dim, generator=gen).to(bf).requires_grad_()
            wg = w1.clone().requires_grad_()
            y = dist_moe.grouped_mm(xg, wg.transpose(1, 2), sent.offsets, backend="triton")
            y.backward(torch.randn(y.shape, generator=gen).to(bf))
    finally:
        launch.row_candidates, launch.weight_candidates = old
        configs._chosen.clear()
    return seen


def _hopper_rows(configs, role):
    with _capability(9, 0):
        return configs.row_candidates(role, torch.device("cuda"), torch.bfloat16)


def _hopper_weights(configs, tma):
    with _capability(9, 0):
        return configs.weight_candidates(torch.device("cuda"), torch.bfloat16, tma=tma)


@contextmanager
def _capability(major, minor):
    import dist_moe.kernels.configs as configs

    saved_interp, saved_cap = configs.interpreting, configs._capability
    configs.interpreting = lambda: False
    configs._capability = lambda device: (major, minor)
    try:
        yield
    finally:
        configs.interpreting, configs._capability = saved_interp, saved_cap


@contextmanager
def _pretend_triton_on_cpu():
    """Let the Triton path take CPU tensors (launches are only recorded, never run)."""
    import dist_moe.kernels.launch as launch

    saved_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # resolve_backend then allows CPU tensors
    saved_sms = launch._num_sms
    launch._num_sms = lambda device: 132
    try:
        yield
    finally:
        launch._num_sms = saved_sms
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def describe(kwargs: dict) -> str:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_R", "EPILOGUE", "A_GATHER", "A_PADDED", "TWO_B", "CONCAT_K",
            "A_TMA", "B_TMA", "B_K_CONTIG", "TMA", "OUT_TMA", "FLATTEN", "WARP_SPECIALIZE",
            "num_warps", "num_stages")
    return " ".join(f"{k}={kwargs[k]}" for k in keys if k in kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the first candidate of each kernel")
    args = parser.parse_args()
    return check(layer_launches(args.quick))


def check(launches: list) -> int:
    """Compile each distinct captured launch for sm_90 and print one line per variant; the number failing."""
    if native_specialize_impl is None:
        print("this triton has no native_specialize_impl; cannot compile ahead of time")
        return 1
    seen, failures = set(), 0
    print(f"triton {triton.__version__}, target sm_90; {len(launches)} launches captured")
    for kernel, call_args, kwargs in launches:
        if kernel.__name__ in MEMORY_BOUND and kernel.__name__ in seen:
            continue
        signature, constexprs, attrs, options = specialise(kernel, call_args, kwargs)
        key = (kernel.__name__, tuple(sorted(signature.items())), tuple(sorted((k, str(v)) for k, v in constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        if kernel.__name__ in MEMORY_BOUND:
            seen.add(kernel.__name__)
        start = time.time()
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                                      options=options)
        except Exception as err:
            failures += 1
            print(f"FAIL compile {kernel.__name__} {describe(kwargs)}: {type(err).__name__}: {str(err)[:300]}")
            continue
        info = inspect_compiled(compiled)
        problems = []
        if kernel.__name__ not in MEMORY_BOUND:
            if not info["wgmma"]:
                problems.append("no wgmma")
            if not (info["cp_async"] or info["tma"]):
                problems.append("main loop not pipelined (no cp.async / TMA)")
            if constexprs.get("WARP_SPECIALIZE") and not info["specialized"]:
                problems.append("loop not warp-specialized")
        if info["shared"] > SMEM_LIMIT:
            problems.append(f"shared memory {info['shared']} > {SMEM_LIMIT}")
        warning = ""
        if info["spill_bytes"]:  # a few bytes (epilogue) are harmless; many mean a tile too large
            if info["spill_bytes"] > SPILL_LIMIT:
                problems.append(f"{info['spill_bytes']} bytes of register spills")
            else:
                warning = f" (spills {info['spill_bytes']} B)"
        failures += bool(problems)
        status = "FAIL " + "; ".join(problems) if problems else "ok"
        # Programs one SM can hold at once (persistent launches with several programs per SM need >= that).
        threads = 32 * options.get("num_warps", 4)
        per_sm = min(SM_SHARED // max(info["shared"], 1),
                     SM_REGISTERS // (info["registers"] * threads) if info["registers"] else 99)
        print(f"{status:4s} {kernel.__name__:18s} {time.time() - start:5.1f}s smem {info['shared'] // 1024:3d}K "
              f"({per_sm}/SM) "
              f"regs {info['registers']} cp.async {info['cp_async']:3d} tma {info['tma']:2d}"
              f"{' boxes ' + ','.join('x'.join(map(str, b)) for b in info['boxes']) if info['boxes'] else ''}  "
              f"{describe(kwargs)}{warning}",
              flush=True)
    print(f"{len(seen)} variants, {failures} failing")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
