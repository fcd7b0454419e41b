"""The op names the remat options save, and how an aten op is named."""
from __future__ import annotations

# The ops whose outputs are worth keeping: products and attention (recomputing them costs most).
MATMUL_OPS = ("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm")
# fused_attention: saved.py's stand-in for a fused kernel while the planner profiles on meta
ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "flex_attention", "fused_attention")


def op_name(func) -> str:
    return func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)
