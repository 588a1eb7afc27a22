"""The stacked expert weights a mixture-of-experts layer hands the fused kernels, and the
name their tuned tiles are filed under. No Triton here: the model layers import it on any
machine."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertWeights(NamedTuple):
    """One projection of every expert, stacked. Dense: weight [E, N, K]. Quantized, as the
    weight-only kernels take a layer (quantization.base.KernelWeight): weight [E, N, K] int8 or
    float8_e4m3fn, or [E, N, K / 2] nibble pairs (four_bit: even k in the low nibble); w =
    q x scale (+ offset) with scale and offset [E, N, K / group_size]."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    group_size: int = 0
    four_bit: bool = False

    @property
    def in_features(self) -> int:
        return self.weight.shape[2] * (2 if self.four_bit else 1)


def weight_format(weights: ExpertWeights, activation_dtype: torch.dtype) -> str:
    """The name tuned configs are filed under: the activation dtype for dense experts, else
    the stored format and group size (int4-g128, float8_e4m3fn-g4096, ...)."""
    if weights.scale is None:
        return str(activation_dtype).removeprefix("torch.")
    stored = "int4" if weights.four_bit else str(weights.weight.dtype).removeprefix("torch.")
    return f"{stored}-g{weights.group_size}"
