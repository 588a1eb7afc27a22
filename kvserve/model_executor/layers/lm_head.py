"""The LM head's matmul. On CPU, the few fp32 rows of a decode step (one per sequence) go
through kvserve's own kernel: MKL's sgemv read SmolLM2's 113 MB head at ~8 GB/s of the
~18.5 a plain read of it reaches on a 2-core EPYC (BENCHMARKS.md, "CPU: the fp32 LM head")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.quantization.cpu_kernels import float_matmul_op

# Rows up to this take the kernel: measured 1.5x MKL at 1 row, 3.8x at 2, 2.2x at 16.
KERNEL_MAX_ROWS = 16


def lm_head_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of hidden_states [T, H] against the head's weight [V, H]."""
    if (hidden_states.device.type == "cpu" and hidden_states.dim() == 2
            and hidden_states.dtype == weight.dtype == torch.float32
            and hidden_states.shape[0] <= KERNEL_MAX_ROWS and weight.is_contiguous()):
        kernel = float_matmul_op()
        if kernel is not None:
            return kernel(hidden_states, weight)
    return F.linear(hidden_states, weight).float()
