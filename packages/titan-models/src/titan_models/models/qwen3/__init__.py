from titan_models.models.qwen3.flavors import FLAVORS
from titan_models.models.qwen3.model import Qwen3Config

__all__ = ["FLAVORS", "Qwen3Config"]
