"""Low-precision (fp8 / MXFP8) training of Linear layers: the recipes, their quantisation and GEMMs, the
QuantizedLinear module and the conversion pass that puts it in place of the selected nn.Linears."""
from .convert import DEFAULT_EXCLUDED, LinearConversion
from .linear import QuantizedLinear, quantized_linear
from .recipes import RECIPES, Recipe
from .scaling import Blocking, QuantizedMatrix, quantize

__all__ = ["DEFAULT_EXCLUDED", "RECIPES", "Blocking", "LinearConversion", "QuantizedLinear", "QuantizedMatrix",
           "Recipe", "quantize", "quantized_linear"]
