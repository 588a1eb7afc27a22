"""RMSNorm, computed in fp32 as Hugging Face Llama does, optionally fused with the
residual add that precedes it (one Triton kernel on CUDA), with the linears on either side
of it (PendingNorm), or with the next linear's fp8 quantization (Fp8Rows)."""

from __future__ import annotations

from typing import Protocol, TypeGuard

import torch
from torch import nn

from kvserve import envs
from kvserve.model_executor.layers.linear import Linear
from kvserve.ops.pending_norm import PendingNorm
from kvserve.ops.quant.fp8_rows import Fp8Rows
from kvserve.quantization.base import takes_fp8_rows


class PendingNormProducer(Protocol):
    """A layer whose last kernel can leave the RMSNorm after it pending (PendingNorm): its
    epilogue adds the layer's output to the residual stream and keeps the norm's sums.
    QuantizedLinear, the dense Linear and SparseMoE are ones (a mixture's x may itself be a
    PendingNorm)."""

    def add_norm_matmul(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> PendingNorm | None: ...


class PendingNormConsumer(Protocol):
    """A layer whose kernels can finish an RMSNorm left pending before it: its forward takes
    the PendingNorm where folds_pending_norm says so. QuantizedLinear, the dense Linear and
    SparseMoE are ones."""

    def folds_pending_norm(self, rows: int, dtype: torch.dtype) -> bool: ...


# hasattr, not a runtime-checkable Protocol's isinstance: that takes 4-8 us, twice a layer in
# every eager step.
def _is_producer(module: object) -> TypeGuard[PendingNormProducer]:
    return hasattr(module, "add_norm_matmul")


def _is_consumer(module: object) -> TypeGuard[PendingNormConsumer]:
    return hasattr(module, "folds_pending_norm")


def _two_dense_gemvs(producer: object, consumer: object) -> bool:
    """Two dense one-row GEMVs keep the norm's own kernel between them: fused, they lose more
    than the ~1.5 us kernel saves (H200, llama3-8b W2 batch 1: 4.21 ms a token against 4.08;
    q/k/v 12.5 -> 16.6 us, gate/up 56.2 -> 58.7). Likely cause: the consumer's programs find
    the multiprocessors full of the producer's and load no weights ahead of its end, where
    beside the short norm kernel they do. Next to a mixture of experts' short routing and
    combine kernels the fusion pays (qwen3-30b-a3b: 2.69 against 2.81 ms)."""
    return isinstance(producer, Linear) and isinstance(consumer, Linear)


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
        self, linear: nn.Module, x: torch.Tensor | Fp8Rows | PendingNorm, residual: torch.Tensor,
        consumer: nn.Module | None
    ) -> tuple[torch.Tensor | PendingNorm | Fp8Rows, torch.Tensor]:
        """(norm(residual + linear(x)), residual + linear(x)), the norm's output going to
        `consumer` (a linear or a mixture of experts; None: anything else). Where the norm
        `fuses_into` the two, the add and the norm's sums run in the producer's epilogue and
        the result is a PendingNorm that the consumer finishes; where the consumer
        multiplies fp8 by fp8 (its `takes_fp8_rows`), the norm's kernel quantizes its output
        (Fp8Rows). residual is updated in place either way on CUDA."""
        if not isinstance(x, Fp8Rows) and self.fuses_into(linear, consumer, x):
            fused = linear.add_norm_matmul(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused, residual
        y = linear(x)
        if y.is_cuda and y.dim() == 2 and self.weight.dtype == y.dtype and takes_fp8_rows(
                consumer, y.shape[0], y.dtype):
            from kvserve.ops.elementwise import add_rms_norm

            return add_rms_norm(y, self.weight, self.eps, residual, fp8=True), residual
        return self(y, residual)

    def fuses_into(self, linear: nn.Module, consumer: nn.Module | None, x: torch.Tensor | PendingNorm) -> bool:
        """Whether add_after runs this norm inside `linear` (before it, taking x: a
        PendingNormProducer) and `consumer` (after it: a PendingNormConsumer whose kernels
        finish the norm for x's rows; the producer may still decline in add_norm_matmul).
        KVSERVE_FUSED_NORMS=0 keeps every norm's own kernel (read last: the consumers decline
        off CUDA, and a compiled CPU decode graph then never reads the environment)."""
        rows = x.rows if isinstance(x, PendingNorm) else x
        return (_is_producer(linear) and _is_consumer(consumer) and not _two_dense_gemvs(linear, consumer)
                and consumer.folds_pending_norm(rows.shape[0], rows.dtype) and envs.KVSERVE_FUSED_NORMS)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)
