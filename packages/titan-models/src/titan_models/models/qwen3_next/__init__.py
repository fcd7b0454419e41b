"""Qwen3-Next: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.models.qwen3_next.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.qwen3_next.hf import TINY_HF_CONFIGS, Qwen3NextConverter
from titan_models.models.qwen3_next.model import Qwen3NextConfig
from titan_models.registry import Family, register

FAMILY = register(Family(name="qwen3_next", config_type=Qwen3NextConfig, flavors=FLAVORS,
                         published_sizes=PUBLISHED_PARAMS, hf=Qwen3NextConverter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "Qwen3NextConfig", "Qwen3NextConverter"]
