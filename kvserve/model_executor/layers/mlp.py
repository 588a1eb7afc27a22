"""The SwiGLU MLP of the Llama family, on a fused gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.model_executor.layers.activation import SiluAndMul
from kvserve.model_executor.layers.layernorm import PendingNorm
from kvserve.model_executor.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """down_proj's input, the activation: a dense layer applies down_proj itself, fused
        with the norm after it where it can (LlamaDecoderLayer)."""
        return self.act(self.gate_up_proj(x))

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The whole MLP, down_proj included (an expert's output)."""
        return self.down_proj(self(x))
