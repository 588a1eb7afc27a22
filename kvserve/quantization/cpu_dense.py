"""Dense CPU copies of weights in oneDNN's blocked layout, for the dense (prefill) path.

A plain-layout weight is re-blocked by oneDNN on every matmul; packing it once at load
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU weight prepacking uses)
skips that. Measured over SmolLM2's 120 linears on the 2-core AMX Xeon of BENCHMARKS.md:
bf16 512 rows 233 -> 87 ms, 16 rows 18.8 -> 12.2 ms; fp32 512 rows 459 -> 344 ms; results
identical to F.linear.

A packed weight is an opaque tensor that torch.compile cannot trace, so layers call it
through the `kvserve::packed_linear` op by an integer handle: the compiled CPU decode graph
calls the op like any kernel, and only the op looks the weight up.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

# The row count oneDNN blocks the weight for; any row count runs on the packed weight.
_PACK_ROWS_HINT = 16
# Handle -> packed weight. Weak: the layer that packed it owns it.
_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handles = itertools.count()


class DenseWeight:
    """A float weight for the dense path: in oneDNN's layout with its op handle where
    packing applies (`pack`, CPU, fp32/bf16), else the plain tensor (the caller's own when
    it already has `dtype`: no copy)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, pack: bool = True) -> None:
        weight = weight.detach().to(dtype)
        self.handle: int | None = None
        if (pack and weight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and torch.backends.mkldnn.is_available()):
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)
            self.handle = next(_handles)
            _PACKED[self.handle] = weight
        self.tensor = weight
        self.out_features = weight.shape[0]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T computed in the weight's dtype, returned in x's dtype."""
        if self.handle is None:
            return F.linear(x.to(self.tensor.dtype), self.tensor).to(x.dtype)
        return torch.ops.kvserve.packed_linear(x, self.handle, self.out_features)

    def plain(self) -> torch.Tensor:
        """The weight in the plain [out, in] layout (for checks and dequantizing)."""
        return self.tensor.to_dense() if self.tensor.is_mkldnn else self.tensor


@torch.library.custom_op("kvserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    weight = _PACKED[handle]
    y = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "")
    return y.to(x.dtype)


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
