"""The fp64 reference of kvserve's int4 CPU kernel (4- and 5-bit weights)."""

from __future__ import annotations

import torch

from kvserve.quantization.int4 import dequantize_int4


def reference_terms(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x's row scales, x rounded to int16 as the kernel rounds it, the weight's q * scale part,
    its minimums part), fp64: the kernel computes x_rounded @ scaled.T + x @ offsets.T (it sums
    each group of unrounded x for the minimums)."""
    x_scale = x.abs().amax(dim=1, keepdim=True) / 32767
    x_rounded = torch.round(x * (1 / x_scale)).double() * x_scale.double()
    scaled = dequantize_int4(q, scale, torch.zeros_like(minimum)).double()
    offsets = dequantize_int4(torch.zeros_like(q), scale, minimum).double()
    return x_scale, x_rounded, scaled, offsets
