"""Kimi Linear: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.accounting import ParamCount
from titan_models.models.kimi_linear.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.kimi_linear.hf import TINY_HF_CONFIGS, KimiLinearConverter
from titan_models.models.kimi_linear.model import KimiLinearConfig
from titan_models.registry import Family, register



def _as_published(counts: ParamCount) -> tuple[int, int]:
    # Without the input embedding (a lookup), as DeepSeek counts its activated figure: 48.75B / 3.11B for
    # 48B-A3B, whose whole count (49.12B, equal to transformers') is 2.3% above the card's "48B".
    return counts.main - counts.embedding, counts.active - counts.embedding


FAMILY = register(Family(name="kimi_linear", config_type=KimiLinearConfig, flavors=FLAVORS,
                         published_sizes=PUBLISHED_PARAMS, count_as_published=_as_published,
                         hf=KimiLinearConverter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "KimiLinearConfig", "KimiLinearConverter"]
