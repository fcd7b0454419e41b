"""Muse Spark (text model): the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.accounting import ParamCount
from titan_models.models.muse_spark.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.muse_spark.hf import TINY_HF_CONFIGS, MuseSparkConverter
from titan_models.models.muse_spark.model import MLP_LAYER_TYPES, MuseSparkConfig, muse_spark_moe
from titan_models.registry import Family, register


def _as_published(counts: ParamCount) -> tuple[int, int]:
    # "816B-parameter language backbone, 42B active": without the input embedding and output tables
    tables = 2 * counts.embedding
    return counts.main - tables, counts.active - tables


FAMILY = register(Family(
    name="muse_spark", config_type=MuseSparkConfig, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    count_as_published=_as_published, hf=MuseSparkConverter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "MLP_LAYER_TYPES", "MuseSparkConfig", "MuseSparkConverter", "muse_spark_moe"]
