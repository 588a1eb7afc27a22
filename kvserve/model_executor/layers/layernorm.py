"""RMSNorm, computed in fp32 as Hugging Face Llama does, optionally fused with the
residual add that precedes it (one Triton kernel on CUDA), with the linears on either side
of it (PendingNorm), or with the next linear's fp8 quantization (Fp8Rows)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.ops.quant.fp8_rows import Fp8Rows
from kvserve.ops.pending_norm import PendingNorm
from kvserve.quantization.base import QuantizedLinear, takes_fp8_rows


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
            from kvserve.ops.elementwise import add_rms_norm

            out = add_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def add_after(
        self, linear: nn.Module, x: torch.Tensor | Fp8Rows, residual: torch.Tensor, consumer: nn.Module | None
    ) -> tuple[torch.Tensor | PendingNorm | Fp8Rows, torch.Tensor]:
        """(norm(residual + linear(x)), residual + linear(x)), the norm's output going to
        `consumer` (a linear; None: anything else). Where both are quantized linears whose
        kernels can (the producer's `add_norm_matmul`, the consumer's `folds_pending_norm`),
        the add and the norm's sums run in the linear's epilogue and the result is a
        PendingNorm that the consumer finishes; where the consumer multiplies fp8 by fp8
        (its `takes_fp8_rows`), the norm's kernel quantizes its output (Fp8Rows). residual is
        updated in place either way on CUDA."""
        if (isinstance(x, torch.Tensor) and isinstance(linear, QuantizedLinear)
                and isinstance(consumer, QuantizedLinear) and consumer.folds_pending_norm(x.shape[0], x.dtype)):
            fused = linear.add_norm_matmul(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused, residual
        y = linear(x)
        if y.is_cuda and y.dim() == 2 and self.weight.dtype == y.dtype and takes_fp8_rows(
                consumer, y.shape[0], y.dtype):
            from kvserve.ops.elementwise import add_rms_norm

            return add_rms_norm(y, self.weight, self.eps, residual, fp8=True), residual
        return self(y, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)
