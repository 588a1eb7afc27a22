"""The SwiGLU MLP of the Llama family, on a fused gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model_executor.layers.activation import SiluAndMul
from kvserve.model_executor.layers.linear import Linear
from kvserve.ops.quant.fp8_rows import Fp8Rows
from kvserve.ops.pending_norm import PendingNorm
from kvserve.quantization.base import takes_fp8_rows


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor | Fp8Rows:
        """down_proj's input, the activation (quantized by its kernel where down_proj
        multiplies fp8 by fp8): a dense layer applies down_proj itself, fused with the norm
        after it where it can (LlamaDecoderLayer)."""
        h = self.gate_up_proj(x)
        return self.act(h, fp8=h.is_cuda and takes_fp8_rows(self.down_proj, h.shape[0], h.dtype))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The whole MLP, down_proj included (an expert's output)."""
        return self.down_proj(self(x))
