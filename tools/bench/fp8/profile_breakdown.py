"""Where a profiled training step's GPU time goes, by kind of kernel: read from the Chrome trace torch.profiler
writes (titan-train's --profiling.steps), for bench.py --profile-steps.

Each device kernel (trace category "kernel"; copies and memsets count as "other") goes into one category:
  optimizer           launched inside torch.optim's "Optimizer.step" / "Optimizer.zero_grad" annotations, or
                      named like one (adam, multi_tensor_apply, foreach: gradient clipping's norms too);
  fp8_gemm            launched by aten::_scaled_mm (cuBLAS / CUTLASS fp8), or titan's Triton fp8 GEMMs, or a
                      GEMM kernel whose name says e4m3 / e5m2 / f8;
  attention           flash / fmha / cuDNN SDPA / flex-attention kernels;
  bf16_gemm           launched by aten::mm / addmm / bmm (any cuBLAS kernel), or named like a GEMM;
  quantize_cast_amax  kernels whose (Inductor) name holds amax / frexp / ldexp / fp8 words, and pure dtype casts
                      (Inductor's "fused__to_copy" alone, eager copy kernels). Inductor names a fused kernel by
                      the ops fused into it, so a quantisation fused into its producer (an RMSNorm, SwiGLU's
                      product) counts here whole: the category is an upper bound on quantisation work;
  other               everything else (norms, activations, the loss, embedding, copies).
The launching op comes from the kernel's "External id" (the innermost CPU op that launched it); the optimizer
annotation from the launch call's correlation id and time. Where no op is known the kernel name decides.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

CATEGORIES = ("fp8_gemm", "bf16_gemm", "quantize_cast_amax", "attention", "optimizer", "other")

FP8_GEMM_OPS = ("aten::_scaled_mm", "aten::_scaled_grouped_mm", "titan_train::fp8_scaled_mm",
                "titan_train::fp8_blockwise_gemm")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_grouped_mm", "titan_train::mx_dequantized_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention",
                 "aten::_cudnn_attention", "flash_attn")
FP8_GEMM_KERNELS = ("blockwise_gemm_kernel", "mx_gemm_kernel", "_scaled_mm", "scaled_mm", "f8f8bf16", "fp8_gemm",
                    "fp8_grouped")
FP8_WORDS = ("e4m3", "e5m2", "f8f8", "fp8", "float8", "_qq")
# cuBLAS (12.8+) names its Hopper GEMMs nvjet_*: nvjet_tst_* for bf16, nvjet_qqtst_* for fp8 operands.
GEMM_WORDS = ("gemm", "gemv", "nvjet", "xmma", "cublas", "cutlass", "splitk", "bmm_", "triton_tem_fused_mm",
              "triton_tem_fused_addmm", "triton_tem_fused_bmm", "sm90_", "sm80_", "ampere_", "hopper_")
ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "sdpa")
OPTIMIZER_WORDS = ("adam", "multi_tensor_apply", "foreach", "muon")
OPTIMIZER_ANNOTATIONS = ("Optimizer.step", "Optimizer.zero_grad")
QUANT_WORDS = ("amax", "frexp", "ldexp", "e4m3", "e5m2", "float8", "fp8", "quant")
# A pure dtype cast: Inductor's kernel of nothing but _to_copy, torch's eager copy / cast kernels.
CAST = re.compile(r"^triton_(poi|red|per)_fused__to_copy(_\d+)*$|direct_copy_kernel|copy_kernel")


@dataclass(frozen=True)
class Kernel:
    name: str
    microseconds: float
    op: str = ""
    """The CPU op that launched it ('' when unknown)."""
    in_optimizer: bool = False


def categorize(name: str, op: str = "", in_optimizer: bool = False) -> str:
    """One of CATEGORIES for a kernel (order matters: an fp8 GEMM's name also says e4m3, a flash kernel's cutlass)."""
    n = name.lower()
    if in_optimizer or any(w in n for w in OPTIMIZER_WORDS):
        return "optimizer"
    gemm_named = any(w in n for w in GEMM_WORDS) and "elementwise" not in n
    if (op.startswith(FP8_GEMM_OPS) or any(w in n for w in FP8_GEMM_KERNELS)
            or (gemm_named and any(w in n for w in FP8_WORDS))):
        return "fp8_gemm"
    if op.startswith(ATTENTION_OPS) or any(w in n for w in ATTENTION_WORDS):
        return "attention"
    if op.startswith(GEMM_OPS) or gemm_named:
        return "bf16_gemm"
    if any(w in n for w in QUANT_WORDS) or CAST.search(name):
        return "quantize_cast_amax"
    return "other"


def breakdown(kernels: list[Kernel], *, steps: int, top: int = 15) -> dict:
    """{per_step_ms: {category: ms}, total_ms, top: the `top` kernel names by time, each with its category,
    ms and launches per step}; every figure is per step (the sum over the profiled steps / steps)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    for k in kernels:
        category = categorize(k.name, k.op, k.in_optimizer)
        per_category[category] += k.microseconds
        entry = by_name[k.name]
        entry[0] += k.microseconds
        entry[1] += 1
        entry[2] = entry[2] or category
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"steps": steps,
            "per_step_ms": {c: us / steps / 1e3 for c, us in per_category.items()},
            "total_ms": sum(per_category.values()) / steps / 1e3,
            "top": [{"name": name, "category": cat, "ms": us / steps / 1e3, "calls": calls / steps}
                    for name, (us, calls, cat) in ranked]}


def kernels_from_trace(events: list[dict]) -> list[Kernel]:
    """The device kernels of a Chrome trace's complete ("X") events, with their launching op and whether the
    launch fell inside an optimizer annotation."""
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") in ("user_annotation", "cpu_op") and e.get("name", "").startswith(OPTIMIZER_ANNOTATIONS)]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args", {})
        launched = launches.get(args.get("correlation"))
        in_optimizer = launched is not None and any(a <= launched <= b for a, b in windows)
        name = e["name"] if e["cat"] == "kernel" else f"[{e['cat']}] {e['name']}"
        kernels.append(Kernel(name, float(e["dur"]), ops.get(args.get("External id"), ""), in_optimizer))
    return kernels


def format_breakdown(title: str, result: dict, *, step_ms: float | None = None) -> str:
    """A markdown table of the categories and one of the top kernels."""
    total = result["total_ms"] or 1.0
    head = f"\n#### {title}: GPU kernel time per step ({result['steps']} profiled steps)"
    if step_ms is not None:
        head += f", step {step_ms:.1f} ms (kernel time summed {result['total_ms']:.1f} ms)"
    if "idle_ms" in result:
        head += f"; GPU busy {result['busy_ms']:.1f} ms, idle {result['idle_ms']:.1f} ms a step"
    lines = [head, "", "| category | ms / step | share |", "|---|---|---|"]
    lines += [f"| {c} | {ms:.2f} | {ms / total:.0%} |" for c, ms in result["per_step_ms"].items()]
    lines += [f"| total | {result['total_ms']:.2f} | 100% |", "", "| kernel | category | ms / step | launches |",
              "|---|---|---|---|"]
    lines += [f"| `{k['name'][:90]}` | {k['category']} | {k['ms']:.2f} | {k['calls']:g} |" for k in result["top"]]
    return "\n".join(lines)
