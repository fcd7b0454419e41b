"""Expert-parallel token dispatch/combine and grouped-GEMM kernels (Triton on GPU, torch on CPU)."""

__version__ = "0.1.0"

from dist_moe.dispatch import Dispatched, combine, dispatch
from dist_moe.expert_mlp import expert_mlp
from dist_moe.fp8_quant import Fp8Recipe
from dist_moe.grouped_mm import grouped_mm
from dist_moe.grouped_mm_fp8 import grouped_mm_fp8
from dist_moe.host_sync import HostReads, count_host_syncs
from dist_moe.moe import MoE, MoEConfig, apply_expert_parallel
from dist_moe.overlap import TakingTurns, overlap_all_to_all
from dist_moe.routing import Routing, forced_balance, hash_experts, route, sequence_balance_loss, tokens_per_expert, update_expert_bias

__all__ = [
    "Dispatched",
    "Fp8Recipe",
    "HostReads",
    "MoE",
    "MoEConfig",
    "Routing",
    "TakingTurns",
    "__version__",
    "apply_expert_parallel",
    "combine",
    "count_host_syncs",
    "dispatch",
    "expert_mlp",
    "forced_balance",
    "grouped_mm",
    "grouped_mm_fp8",
    "hash_experts",
    "overlap_all_to_all",
    "route",
    "sequence_balance_loss",
    "tokens_per_expert",
    "update_expert_bias",
]
