"""Shared model definitions (Llama 3, Qwen3 dense and MoE, DeepSeek-V3, gpt-oss), typed configs and Hugging Face weight interop."""

__version__ = "0.1.0"

from titan_models import transforms
from titan_models.accounting import ParamCount, count_params, flops_per_token
from titan_models.context import AttentionContext
from titan_models.hf import from_hf, to_hf
from titan_models.models import deepseek_v3, gpt_oss, llama3, qwen3
from titan_models.models.transformer import Transformer
from titan_models.override import override
from titan_models.parallel_plan import ParallelPlan
from titan_models.registry import Family, PublishedSize, families, family, family_of, flavor, flavors, register

__all__ = [
    "AttentionContext", "Family", "ParallelPlan", "ParamCount", "PublishedSize", "Transformer", "__version__",
    "count_params", "deepseek_v3", "families", "family", "family_of", "flavor", "flavors", "flops_per_token", "from_hf",
    "gpt_oss", "llama3", "override", "qwen3", "register", "to_hf", "transforms",
]
