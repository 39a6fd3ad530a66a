"""quant: quantizers, the quantized-weight type, checkpoint I/O, QuantLinear.

Public API:
    QuantConfig, QuantizedWeight, quantize_tensor, relative_error
    quantize_checkpoint, plan_checkpoint, load_checkpoint, read_header, open_source
    QuantLinear, quantize_model_, load_quantized_
"""

from hilt.errors import HiltError
from hilt.quant.checkpoint import load_checkpoint, plan_checkpoint, quantize_checkpoint, read_header
from hilt.quant.nn import QuantLinear, load_quantized_, quantize_model_
from hilt.quant.quantize import QuantConfig, quantize_tensor, relative_error
from hilt.quant.qweight import QuantizedWeight
from hilt.quant.sources import open_source

__all__ = [
    "HiltError", "QuantConfig", "QuantizedWeight", "QuantLinear", "quantize_tensor", "relative_error",
    "quantize_checkpoint", "plan_checkpoint", "load_checkpoint", "read_header", "open_source", "quantize_model_", "load_quantized_",
]
