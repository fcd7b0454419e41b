"""Kimi K2.x (Kimi-K2.5/K2.6): the DeepSeek-V3 text model with the MoonViT vision tower, registered once."""
from titan_models.accounting import ParamCount
from titan_models.models.kimi_k25.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.kimi_k25.hf import TINY_HF_CONFIGS, KimiK25Converter
from titan_models.models.kimi_k25.model import KimiK25Config, KimiK25Transformer
from titan_models.models.kimi_k25.vision import KimiVisionConfig
from titan_models.registry import Family, register


def _as_published(counts: ParamCount) -> tuple[int, int]:
    # as DeepSeek's: the activated figure leaves out the input embedding (a lookup)
    return counts.main, counts.active - counts.embedding


FAMILY = register(Family(
    name="kimi_k25", config_type=KimiK25Config, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    count_as_published=_as_published, hf=KimiK25Converter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "KimiK25Config", "KimiK25Converter", "KimiK25Transformer", "KimiVisionConfig"]
