"""Activations handed to the next linear already quantized to fp8 (Fp8Rows): where that
linear multiplies fp8 by fp8 (the fp8 weights' W8A8 kernel at decode batches), the RMSNorm
or SwiGLU kernel before it quantizes its own output per row, and the linear's separate
quantization kernel is saved (three of a decoder layer's four)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Fp8Rows(NamedTuple):
    """values [T, K] float8_e4m3fn and scales [T, 1] fp32, row t ~= values[t] * scales[t],
    quantized from rows rounded to `dtype` (the run dtype): the same bits as
    `fp8_activation.quantize_per_token` of the unfused kernel's output."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        return (self.values.float() * self.scales).to(self.dtype)
