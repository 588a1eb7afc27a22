"""Quantization methods by the name users pass as `quantization=`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.quantization.awq import AWQFormat
from kvserve.quantization.base import QuantizationMethod
from kvserve.quantization.checkpoint import CheckpointFormat
from kvserve.quantization.compressed_tensors import compressed_tensors_format
from kvserve.quantization.fp8 import Fp8Method
from kvserve.quantization.fp8_checkpoint import HFFp8Format
from kvserve.quantization.gptq import GPTQFormat
from kvserve.quantization.int4 import Int4Method
from kvserve.quantization.int8 import Int8Method
from kvserve.quantization.nf4 import NF4Method


def _gguf_method() -> type[QuantizationMethod]:
    # Imported on use: it needs the gguf package, which only GGUF files need (the GPU
    # image, for one, does not have it).
    from kvserve.quantization.gguf import GGUFMethod

    return GGUFMethod


# Name -> the method's class, resolved when the method is asked for.
QUANTIZATION_METHODS: dict[str, Callable[[], type[QuantizationMethod]]] = {
    **{method.name: (lambda method=method: method) for method in (Int8Method, Int4Method, NF4Method, Fp8Method)},
    "gguf": _gguf_method,
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
    return QUANTIZATION_METHODS[name]()(config)


# quant_method -> the format that reads it (compressed-tensors: int or fp8 by its config).
CHECKPOINT_FORMATS: dict[str, Callable[[dict[str, Any], str], CheckpointFormat]] = {
    "gptq": GPTQFormat, "awq": AWQFormat, "compressed-tensors": compressed_tensors_format, "fp8": HFFp8Format,
}


def get_checkpoint_format(config: dict[str, Any], source: str) -> CheckpointFormat:
    """The format named by a checkpoint's quantization_config; ValueError naming the
    method or setting when it is not one we load."""
    method = config.get("quant_method")
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"{source}: quantization_config quant_method={method!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_FORMATS)}"
        )
    return CHECKPOINT_FORMATS[method](config, source)
