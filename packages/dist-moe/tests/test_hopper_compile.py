"""The layer's Triton kernels compile for Hopper (sm_90) with the installed triton, on any machine:
wgmma, a pipelined main loop (cp.async / TMA), shared memory within 227 KiB, at most 64 bytes of
register spills per thread. First candidate configuration of each kernel (the benchmark and
tools/bench/moe/check_hopper_compile.py cover the rest)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_layer_kernels_compile_for_sm90_pipelined():
    try:
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
    except ImportError:
        pytest.skip("this triton cannot specialise kernels ahead of time (no native_specialize_impl)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "dist_moe.kernels.hopper_check", "--quick"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failing" in proc.stdout


def test_fp8_kernels_compile_for_sm90_pipelined():
    """The fp8 grouped GEMMs (every recipe's forward, input and weight gradient): fp8 wgmma, cp.async
    pipelining (which needs the aligned, K-major operands the launcher provides), no spills."""
    try:
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
    except ImportError:
        pytest.skip("this triton cannot specialise kernels ahead of time (no native_specialize_impl)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "dist_moe.kernels.fp8_hopper_check"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failing" in proc.stdout and "scaled_weight_gemm_kernel" in proc.stdout
