"""Qwen3.5 dense and MoE: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.models.qwen3_5.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.qwen3_5.hf import TINY_HF_CONFIGS, Qwen3_5Converter
from titan_models.models.qwen3_5.model import HybridConfig, Qwen3_5Config
from titan_models.registry import Family, register

FAMILY = register(Family(name="qwen3_5", config_type=Qwen3_5Config, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
                         hf=Qwen3_5Converter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "HybridConfig", "Qwen3_5Config", "Qwen3_5Converter"]
