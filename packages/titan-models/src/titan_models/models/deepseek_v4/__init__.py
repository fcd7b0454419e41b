"""DeepSeek-V4: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.models.deepseek_v4.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.deepseek_v4.hf import TINY_HF_CONFIGS, DeepSeekV4Converter
from titan_models.models.deepseek_v4.model import MLP_KINDS, DeepSeekV4Config, deepseek_v4_moe
from titan_models.registry import Family, register

FAMILY = register(Family(
    name="deepseek_v4", config_type=DeepSeekV4Config, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    hf=DeepSeekV4Converter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "MLP_KINDS", "DeepSeekV4Config", "DeepSeekV4Converter", "deepseek_v4_moe"]
