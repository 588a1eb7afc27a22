"""SwiGLU on a fused gate/up projection (one Triton kernel on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.ops.quant.fp8_rows import Fp8Rows


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
        """fp8 (CUDA, 2-D x): the output quantized per row (Fp8Rows), in the same kernel."""
        if x.is_cuda and x.dim() == 2:
            from kvserve.ops.elementwise import silu_and_mul

            return silu_and_mul(x, fp8)
        if fp8:
            raise ValueError("SiluAndMul(fp8=True) takes 2-D CUDA tensors")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
