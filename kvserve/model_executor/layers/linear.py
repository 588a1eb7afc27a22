"""The model's dense linears (the fp32/bf16 ones no quantization method replaced) and the LM
head. On CPU, the few fp32 rows of a decode step go through kvserve's own kernel: MKL's
sgemv read SmolLM2's weights at ~8-9 GB/s of the ~18.5 a plain read reaches on a 2-core EPYC,
and the kernel reads each weight tile once for all the rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.ops import cpu as cpu_kernels
from kvserve.ops import dense_gemv
from kvserve.ops.pending_norm import PendingNorm
from kvserve.quantization.base import CPU_KERNEL_MAX_ROWS

# Rows up to this take the kernel: the quantized layers' threshold, which the compiled decode
# graphs cover (another threshold would be one more guard, one more graph). SmolLM2's 120
# decoder linears (425 MB), one step: 23.8 ms at 1 row against MKL's 45.9, 36 vs 121 at 4,
# 66 vs 111 at 16 (2-core EPYC, one run).
KERNEL_MAX_ROWS = CPU_KERNEL_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), x [..., K], weight [N, K]."""
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
            and x.numel() <= KERNEL_MAX_ROWS * weight.shape[1]):
        if cpu_kernels.available():
            y = torch.ops.kvserve_cpu.float_matmul(x.reshape(-1, weight.shape[1]), weight)
            y = y.view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear computed by `linear` (and a GPU decode step's one row by ops/dense_gemv.py):
    the model code's layers, which quantization methods swap for their own (quantize_model)
    and loaders fill like any nn.Linear. Where the GEMV takes the row, an RMSNorm between the
    layer and a mixture of experts runs inside the two (RMSNorm.add_after; the same two
    methods as QuantizedLinear's)."""

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            if dense_gemv.applies(x.rows, self.weight):
                return dense_gemv.gemv(x, self.weight, self.bias)
            x = x.finish()  # only where folds_pending_norm promised what the GEMV then declined
        if dense_gemv.applies(x, self.weight):
            return dense_gemv.gemv(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)

    def folds_pending_norm(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether forward finishes a PendingNorm of `rows` rows in `dtype` inside the GEMV
        (its output scaled): one row that the GEMV takes."""
        return rows == 1 and dense_gemv.takes_row(dtype, self.weight)

    def add_norm_matmul(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> PendingNorm | None:
        """RMSNorm.add_after's fused form: y = x @ W^T added to residual in place by the GEMV,
        the norm after it left pending; None (nothing done) where the GEMV does not take x
        (a pending one included: the models hand a linear before a norm a finished input),
        with a bias, or where residual is not x's one [1, N] contiguous row or the norm's
        weight not [N] in x's dtype."""
        n = self.weight.shape[0]
        if (isinstance(x, PendingNorm) or self.bias is not None or not dense_gemv.applies(x, self.weight)
                or residual.shape != (1, n) or not residual.is_contiguous() or residual.dtype != x.dtype
                or norm_weight.shape != (n,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous()):
            return None
        return PendingNorm(*dense_gemv.gemv_add_norm(x, self.weight, residual, norm_weight), eps)
