"""The fp8 Triton kernels on CPU through TRITON_INTERPRET=1 match float64 quantise-dequantise-matmul.

One subprocess (interpret_fp8_checks.py; the interpreter must be selected before triton is
imported), each check reported as its own test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

EXPECTED = [f"{case}_{what}" for case in ("rowwise_e4m3", "rowwise_e5m2_tails", "blockwise_e4m3", "blockwise_e5m2")
            for what in ("forward", "grad_x", "grad_w")] + ["quantize_bitwise_triton_vs_torch"]


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("interpret_fp8_checks.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_check_ran(results):
    assert sorted(results) == sorted(EXPECTED)


@pytest.mark.parametrize("name", EXPECTED)
def test_kernel_matches_float64(results, name):
    assert results[name]["ok"], results[name]
