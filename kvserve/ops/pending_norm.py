"""An RMSNorm left pending between two linears' kernels (the quantized linears' and the dense
one-row GEMV's fused norms); the kernels' shared Triton pieces are in pending_norm_tiles."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PendingNorm(NamedTuple):
    """RMSNorm(h) left unfinished by the linear that produced h (its kernel did the residual
    add and the norm's sums in its epilogue), for the next linear to finish in its own: rows =
    h * the norm's weight in the run dtype, sums [T, P] fp32 partial sums of h^2 per row, and
    the norm's eps. RMSNorm(h) = rows * rsqrt(mean(h^2) + eps), row by row; a linear is linear,
    so that factor can scale its output instead of its input. At one decode row this saves the
    norm's own kernel between two GEMVs."""

    rows: torch.Tensor
    sums: torch.Tensor
    eps: float

    def finish(self) -> torch.Tensor:
        """The normalized rows, for a consumer that cannot take the factor."""
        mean = self.sums.sum(-1, keepdim=True) / self.rows.shape[-1]
        return (self.rows.float() * torch.rsqrt(mean + self.eps)).to(self.rows.dtype)
