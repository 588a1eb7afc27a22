"""Weight quantization: one `QuantizationMethod` per module, swapped in after loading."""

from kvserve.quantization.base import (
    QuantizationMethod,
    QuantizationReport,
    QuantizedLinear,
    quantize_model,
)
from kvserve.quantization.registry import QUANTIZATION_METHODS, get_quantization_method

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizationMethod",
    "QuantizationReport",
    "QuantizedLinear",
    "get_quantization_method",
    "quantize_model",
]
