"""Shared model definitions (Llama 3, Qwen3 dense and MoE, DeepSeek-V3, Qwen3.5 dense and MoE, Qwen3-Next,
gpt-oss), typed configs and Hugging Face weight interop."""

__version__ = "0.1.0"

from titan_models import transforms
from titan_models.accounting import ParamCount, count_params, flops_per_token
from titan_models.context import AttentionContext
from titan_models.hf import from_hf, to_hf
from titan_models.model_config import ModelConfigBase, check_model_config
from titan_models.models import deepseek_v3, gpt_oss, llama3, qwen3
from titan_models.models.transformer import Transformer
from titan_models.override import override
from titan_models.parallel_plan import ParallelPlan
from titan_models.registry import (
    Family, PublishedSize, TinyHFCase, families, family, family_of, flavor, flavors, register,
)

__all__ = [
    "__version__", "AttentionContext", "check_model_config", "count_params", "deepseek_v3", "families",
    "Family", "family", "family_of", "flavor", "flavors", "flops_per_token", "from_hf", "gpt_oss", "llama3",
    "ModelConfigBase", "override", "ParallelPlan", "ParamCount", "PublishedSize", "qwen3", "register",
    "TinyHFCase", "to_hf", "Transformer", "transforms",
]


def __getattr__(name: str):
    """`tm.<family>` for every family folder (e.g. `tm.llama3`), without a line here per family."""
    import sys

    registered = {f.name for f in families()}
    module = sys.modules.get(f"titan_models.models.{name}")  # imported (and registered) by titan_models.models
    if name not in registered or module is None:
        raise AttributeError(f"module 'titan_models' has no attribute {name!r}")
    return module
