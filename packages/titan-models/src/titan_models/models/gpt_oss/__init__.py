from titan_models.models.gpt_oss.flavors import FLAVORS
from titan_models.models.gpt_oss.model import LAYER_TYPES, GptOssConfig, gpt_oss_moe

__all__ = ["FLAVORS", "LAYER_TYPES", "GptOssConfig", "gpt_oss_moe"]
