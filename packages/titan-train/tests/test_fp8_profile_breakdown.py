"""tools/bench/fp8/profile_breakdown.py (bench.py --profile-steps) on synthetic kernels, without a GPU: kernel names
as cuBLAS, CUTLASS, cuDNN, flash-attention, Inductor and titan's Triton kernels spell them go into the right
category, per-step sums and the top list add up, and a synthetic Chrome trace links kernels to their launching op
and to the optimizer's annotation."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tools/bench/fp8")]

from profile_breakdown import CATEGORIES, Kernel, breakdown, categorize, format_breakdown, kernels_from_trace  # noqa: E402,I001

NAMED = [  # (kernel name, launching op, in the optimizer annotation, category)
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "aten::mm", False, "bf16_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel",
     "", False, "bf16_gemm"),
    ("triton_tem_fused_mm_4", "", False, "bf16_gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "aten::_scaled_mm", False, "fp8_gemm"),
    ("nvjet_qqtst_128x256_128x6_2x1_2cta_v_bz_TNT", "", False, "fp8_gemm"),
    ("bmm_E4m3_E4m3E4m3_Fp32_t128x64x128u2_s6_et64x64", "", False, "fp8_gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel",
     "", False, "fp8_gemm"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int>, "
     "cutlass::float_e4m3_t, cutlass::bfloat16_t>>(Params)", "", False, "fp8_gemm"),
    ("blockwise_gemm_kernel", "titan_train::fp8_blockwise_gemm", False, "fp8_gemm"),
    ("blockwise_gemm_kernel", "", False, "fp8_gemm"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<cutlass::bfloat16_t>>>",
     "aten::_flash_attention_forward", False, "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "", False,
     "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "", False,
     "attention"),
    ("triton_red_fused__to_copy_abs_amax_clamp_frexp_1", "", False, "quantize_cast_amax"),
    ("triton_poi_fused__to_copy_clamp_exp2_frexp_mul_2", "", False, "quantize_cast_amax"),
    ("triton_poi_fused__to_copy_3", "", False, "quantize_cast_amax"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda(c10::Float8_e4m3fn)#1}>", "aten::copy_", False, "quantize_cast_amax"),
    ("triton_poi_fused__to_copy_add_mul_rsqrt_2", "", False, "other"),
    ("triton_per_fused_add_mean_mul_pow_rsqrt_0", "", False, "other"),
    ("cross_entropy_kernel", "", False, "other"),
    ("[gpu_memcpy] Memcpy DtoD (Device -> Device)", "", False, "other"),
    ("adamw_master_kernel", "", False, "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<1>>", "", False,
     "optimizer"),
    ("triton_poi_fused_mul_0", "", True, "optimizer"),
]


@pytest.mark.parametrize(("name", "op", "in_optimizer", "want"), NAMED)
def test_kernel_names_fall_into_their_category(name, op, in_optimizer, want):
    assert categorize(name, op, in_optimizer) == want


def test_the_launching_op_decides_over_the_name():
    """A cuBLAS kernel's name need not say fp8: aten::_scaled_mm makes it an fp8 GEMM, aten::mm a bf16 one."""
    name = "nvjet_tst_128x128_64x6_2x1_v_bz_TNT"
    assert categorize(name, "aten::_scaled_mm") == "fp8_gemm"
    assert categorize(name, "aten::mm") == "bf16_gemm"
    assert categorize(name) == "bf16_gemm"


def test_breakdown_sums_per_step_and_ranks_the_top_kernels():
    kernels = [Kernel("nvjet_tst_a", 300.0, "aten::_scaled_mm"), Kernel("nvjet_tst_a", 300.0, "aten::_scaled_mm"),
               Kernel("nvjet_tst_b", 200.0, "aten::mm"), Kernel("triton_red_fused_abs_amax_0", 50.0),
               Kernel("flash_fwd_kernel", 80.0), Kernel("adamw_master_kernel", 40.0),
               Kernel("triton_poi_fused_add_1", 30.0), Kernel("triton_poi_fused_add_1", 30.0)]
    got = breakdown(kernels, steps=2, top=3)
    assert set(got["per_step_ms"]) == set(CATEGORIES)
    want = {"fp8_gemm": 0.3, "bf16_gemm": 0.1, "quantize_cast_amax": 0.025, "attention": 0.04, "optimizer": 0.02,
            "other": 0.03}
    assert got["per_step_ms"] == pytest.approx(want)
    assert got["total_ms"] == pytest.approx(sum(k.microseconds for k in kernels) / 2 / 1e3)
    assert [k["name"] for k in got["top"]] == ["nvjet_tst_a", "nvjet_tst_b", "flash_fwd_kernel"]
    assert got["top"][0] == {"name": "nvjet_tst_a", "category": "fp8_gemm", "ms": pytest.approx(0.3), "calls": 1.0}
    table = format_breakdown("8B fp8_rowwise", got, step_ms=1.0)
    assert "| fp8_gemm | 0.30 | 58% |" in table and "`nvjet_tst_a`" in table
    with pytest.raises(ValueError):
        breakdown(kernels, steps=0)


def _launch(ts: float, correlation: int, cat: str = "cuda_runtime") -> dict:
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "args": {"correlation": correlation}}


def test_kernels_from_a_chrome_trace():
    """Kernels link to their op by External id and to Optimizer.step by their launch's correlation and time;
    host-only events are not kernels."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::_scaled_mm", "ts": 10, "dur": 5, "args": {"External id": 7}},
        _launch(11, 70),
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_x", "ts": 20, "dur": 100,
         "args": {"External id": 7, "correlation": 70}},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#MasterWeightAdamW.step", "ts": 200, "dur": 50,
         "args": {"External id": 8}},
        _launch(210, 71, "cuda_driver"),
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_mul_0", "ts": 260, "dur": 10,
         "args": {"External id": 8, "correlation": 71}},
        _launch(300, 72),
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_mul_0", "ts": 310, "dur": 4,
         "args": {"correlation": 72}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 320, "dur": 2, "args": {}},
    ]
    kernels = kernels_from_trace(events)
    assert kernels == [Kernel("nvjet_tst_x", 100.0, "aten::_scaled_mm", False),
                       Kernel("triton_poi_fused_mul_0", 10.0, "", True),
                       Kernel("triton_poi_fused_mul_0", 4.0, "", False),
                       Kernel("[gpu_memset] Memset (Device)", 2.0, "", False)]
    got = breakdown(kernels, steps=1)["per_step_ms"]
    assert got["fp8_gemm"] == pytest.approx(0.1) and got["optimizer"] == pytest.approx(0.01)
    assert got["other"] == pytest.approx(0.006)
