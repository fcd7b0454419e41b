"""Llama 3 (3.1 / 3.2 sizes): the family's config, flavors and Hugging Face converter, registered once."""
from titan_models.components.rope import Llama3RopeScaling
from titan_models.models.llama3.flavors import FLAVORS, PUBLISHED_PARAMS
from titan_models.models.llama3.hf import TINY_HF_CONFIGS, Llama3Converter
from titan_models.models.llama3.model import Llama3Config
from titan_models.registry import Family, register

FAMILY = register(Family(
    name="llama3", config_type=Llama3Config, flavors=FLAVORS, published_sizes=PUBLISHED_PARAMS,
    hf=Llama3Converter(), vllm_architectures={"TitanLlamaForCausalLM": "LlamaForCausalLM"},
    tiny_hf_configs=TINY_HF_CONFIGS))

__all__ = ["FAMILY", "FLAVORS", "Llama3Config", "Llama3Converter", "Llama3RopeScaling"]
