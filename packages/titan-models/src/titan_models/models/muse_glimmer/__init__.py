"""Muse Glimmer: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.accounting import ParamCount
from titan_models.models.muse_glimmer.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.muse_glimmer.hf import TINY_HF_CONFIGS, MuseGlimmerConverter
from titan_models.models.muse_glimmer.model import LAYER_TYPES, MuseGlimmerConfig, MuseTextConfig
from titan_models.registry import Family, register

# The released checkpoint's vision tower, adapter and projection (transformers 5.20's default
# MuseGlimmerConfig counted on the meta device), which Meta's "30B" includes and the text model does not.
PERCEPTION_PARAMS = 1_921_845_760


def _as_published(counts: ParamCount) -> tuple[int, int]:
    return counts.main + PERCEPTION_PARAMS, counts.active + PERCEPTION_PARAMS


FAMILY = register(Family(
    name="muse_glimmer", config_type=MuseGlimmerConfig, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    count_as_published=_as_published, hf=MuseGlimmerConverter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "LAYER_TYPES", "MuseGlimmerConfig", "MuseGlimmerConverter", "MuseTextConfig"]
