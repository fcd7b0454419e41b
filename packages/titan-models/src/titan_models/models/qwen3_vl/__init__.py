"""Qwen3-VL: the Qwen3 text model with a vision tower, interleaved MRoPE and DeepStack, registered once."""
from titan_models.models.qwen3_vl.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.qwen3_vl.hf import TINY_HF_CONFIGS, Qwen3VLConverter
from titan_models.models.qwen3_vl.model import Qwen3VLConfig, Qwen3VLTransformer
from titan_models.models.qwen3_vl.positions import mrope_positions
from titan_models.models.qwen3_vl.vision import VisionConfig
from titan_models.registry import Family, register

FAMILY = register(Family(
    name="qwen3_vl", config_type=Qwen3VLConfig, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    hf=Qwen3VLConverter(), tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "Qwen3VLConfig", "Qwen3VLConverter", "Qwen3VLTransformer", "VisionConfig",
           "mrope_positions"]
