"""Dense CPU copies of weights in oneDNN's blocked layout, for the dense (prefill) path.

A plain-layout weight is re-blocked by oneDNN on every matmul; packing it once at load
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU weight prepacking uses)
skips that. Measured over SmolLM2's 120 linears on the 2-core AMX Xeon of BENCHMARKS.md:
bf16 512 rows 233 -> 87 ms, 16 rows 18.8 -> 12.2 ms; fp32 512 rows 459 -> 344 ms; results
identical to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN blocks the weight for; any row count runs on the packed weight.
_PACK_ROWS_HINT = 16


def pack_dense_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` [out, in] in `dtype`, packed for oneDNN where it runs (CPU, fp32/bf16)."""
    weight = weight.detach().to(dtype)
    if (weight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()):
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)
    return weight


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T computed in the weight's dtype, returned in x's dtype."""
    inputs = x.to(weight.dtype)
    if weight.is_mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(inputs, weight, None, "none", [], "")
    else:
        y = F.linear(inputs, weight)
    return y.to(x.dtype)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed weight back in the plain [out, in] layout (for checks and dequantizing)."""
    return weight.to_dense() if weight.is_mkldnn else weight
