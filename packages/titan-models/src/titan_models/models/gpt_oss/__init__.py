"""gpt-oss: the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.accounting import ParamCount
from titan_models.models.gpt_oss.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.gpt_oss.hf import TINY_HF_CONFIGS, GptOssConverter
from titan_models.models.gpt_oss.model import LAYER_TYPES, GptOssConfig, gpt_oss_moe
from titan_models.registry import Family, register


def _as_published(counts: ParamCount) -> tuple[int, int]:
    # OpenAI's active figures count the unembedding but not the input embedding (a lookup)
    return counts.main, counts.active - counts.embedding


FAMILY = register(Family(
    name="gpt_oss", config_type=GptOssConfig, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    count_as_published=_as_published, hf=GptOssConverter(), tiny_hf_configs=TINY_HF_CONFIGS,
    vllm_architectures={"TitanGptOssForCausalLM": "GptOssForCausalLM"}))

__all__ = ["FAMILY", "FLAVORS", "LAYER_TYPES", "GptOssConfig", "GptOssConverter", "gpt_oss_moe"]
