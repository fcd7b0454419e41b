from titan_models.components.rope import Llama3RopeScaling
from titan_models.models.llama3.flavors import FLAVORS
from titan_models.models.llama3.model import Llama3Config

__all__ = ["FLAVORS", "Llama3Config", "Llama3RopeScaling"]
