from titan_models.components.rope import YarnRopeScaling
from titan_models.models.deepseek_v3.flavors import FLAVORS
from titan_models.models.deepseek_v3.model import DeepSeekV3Config, DeepSeekV3Transformer, MultiTokenPrediction

__all__ = ["FLAVORS", "DeepSeekV3Config", "DeepSeekV3Transformer", "MultiTokenPrediction", "YarnRopeScaling"]
