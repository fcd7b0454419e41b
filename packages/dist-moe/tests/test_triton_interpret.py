"""The Triton kernels on CPU through TRITON_INTERPRET=1 (float32, tiny shapes) match float64.

The interpreter must be selected before triton is imported, so the checks run in one subprocess
(interpret_checks.py); each check is reported here as its own test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

EXPECTED = [
    *(f"row_gemm_{layout}_weights_{launch}" for layout in ("k_contiguous", "n_contiguous")
      for launch in ("grid", "persistent", "tma")),
    *(f"weight_gemm_{how}_{size}" for how in ("pointer", "padded_tma", "padded_split")
      for size in ("16", "32", "tma_store", "warp_specialized")),
    "weight_gemm_specialized_kernel_ran",
    "gather_rows_padded_layout", "padded_ends", "invert_slots", "slot_sum_weighted", "slot_sum_unweighted",
    "grouped_mm_forward", "grouped_mm_grad_x", "grouped_mm_grad_w",
    *(f"{case}_{what}" for case in ("expert_mlp_top2_weighted", "expert_mlp_top2_tma_persistent",
                                    "expert_mlp_top2_torch_weight_grad", "expert_mlp_top2_keep_routed",
                                    "expert_mlp_top2_tma_persistent_keep_routed")
      for what in ("forward", "grad_x", "grad_w1", "grad_w2", "grad_w3", "grad_weights", "saves")),
    *(f"{case}_{what}" for case in ("expert_mlp_top1_unweighted", "expert_mlp_top2_frozen_weights",
                                    "expert_mlp_top1_keep_routed")
      for what in ("forward", "grad_x", "grad_w1", "grad_w2", "grad_w3", "saves")),
]


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("interpret_checks.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_check_ran(results):
    assert sorted(results) == sorted(EXPECTED)


@pytest.mark.parametrize("name", EXPECTED)
def test_kernel_matches_float64(results, name):
    assert results[name]["ok"], results[name]
