"""RMSNorm, computed in fp32 as Hugging Face Llama does, optionally fused with the
residual add that precedes it (one Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual: (norm(residual + x), residual + x)."""
        if x.is_cuda and x.dim() == 2:
            from kvserve.model_executor.layers.triton_ops import add_rms_norm

            out = add_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)
