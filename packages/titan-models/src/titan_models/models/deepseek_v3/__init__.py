"""DeepSeek-V3: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.accounting import ParamCount
from titan_models.components.rope import YarnRopeScaling
from titan_models.models.deepseek_v3.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.deepseek_v3.hf import TINY_HF_CONFIGS, DeepSeekV3Converter
from titan_models.models.deepseek_v3.model import DeepSeekV3Config, DeepSeekV3Transformer, MultiTokenPrediction
from titan_models.registry import Family, register


def _as_published(counts: ParamCount) -> tuple[int, int]:
    # DeepSeek's sizes leave out the MTP module, and its activated figures the input embedding (a lookup)
    return counts.main, counts.active - counts.embedding


FAMILY = register(Family(
    name="deepseek_v3", config_type=DeepSeekV3Config, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    count_as_published=_as_published, hf=DeepSeekV3Converter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "DeepSeekV3Config", "DeepSeekV3Converter", "DeepSeekV3Transformer",
           "MultiTokenPrediction", "YarnRopeScaling"]
