"""Quantization methods by the name users pass as `quantization=`."""

from __future__ import annotations

from typing import Any

from kvserve.quantization.base import QuantizationMethod
from kvserve.quantization.gguf import GGUFMethod
from kvserve.quantization.int4 import Int4Method
from kvserve.quantization.int8 import Int8Method
from kvserve.quantization.nf4 import NF4Method

QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {
    method.name: method for method in (Int8Method, Int4Method, NF4Method, GGUFMethod)
}


def get_quantization_method(
    name: str | None, config: dict[str, Any] | None = None
) -> QuantizationMethod | None:
    if name is None:
        if config:
            raise ValueError("quantization_config was given without a quantization method")
        return None
    if name not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {name!r}; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    return QUANTIZATION_METHODS[name](config)
