"""SwiGLU on a fused gate/up projection (one Triton kernel on CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    # As RMSNorm.fp8_rows_wanted: set where the output feeds an fp8 linear.
    fp8_rows_wanted: Callable[[int, torch.dtype, torch.device], bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            from kvserve.model_executor.layers.triton_ops import silu_and_mul

            fp8_rows = self.fp8_rows_wanted is not None and self.fp8_rows_wanted(x.shape[0], x.dtype, x.device)
            return silu_and_mul(x, fp8_rows)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
