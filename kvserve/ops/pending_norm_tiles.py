"""The Triton pieces of an RMSNorm left pending between two linears' kernels (PendingNorm,
kvserve.ops.pending_norm), shared by every kernel that takes part: the producer's epilogue
(add_norm_store) and the consumer's row factor (norm_row_scale)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_norm_store(y, rows, cols, row_mask, col_mask, out_ptr, stride_om, residual_ptr, norm_weight_ptr,
                   sum_squares_ptr):
    """A linear's [rows, cols] block y, with the residual add and the RMSNorm after it fused
    (PendingNorm): h = residual + y in the run dtype (the residual stream, updated in place,
    same strides as out), out = h * the norm's weight, and the block's sum of h^2 for each row
    at sum_squares[row, column block]. The next linear multiplies its output rows by
    rsqrt(mean(h^2) + eps) (norm_row_scale)."""
    dtype = out_ptr.dtype.element_ty
    offs = rows[:, None] * stride_om + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    # Rounded as `residual + linear(x)` would be: y to the run dtype, then the sum.
    residual = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (y.to(dtype).to(tl.float32) + residual).to(dtype)
    tl.store(residual_ptr + offs, h, mask=mask)
    h = h.to(tl.float32)
    tl.store(sum_squares_ptr + rows * tl.num_programs(0) + tl.program_id(0), tl.sum(h * h, axis=1), mask=row_mask)
    weight = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (weight[None, :] * h).to(dtype), mask=mask)


@triton.jit
def load_norm_sums(sum_squares_ptr, rows, row_mask, num_partials, PARTIALS: tl.constexpr):
    """The num_partials (<= PARTIALS, a power of two) block sums of h^2 that add_norm_store
    left for each row of x, [rows, PARTIALS] (0 past num_partials)."""
    parts = tl.arange(0, PARTIALS)
    return tl.load(sum_squares_ptr + rows[:, None] * num_partials + parts[None, :],
                   mask=row_mask[:, None] & (parts < num_partials)[None, :], other=0.0)


@triton.jit
def row_scale_of(sums, num_cols, eps):
    """rsqrt(mean(h^2) + eps) for each row of load_norm_sums' block sums, added up in a
    fixed order (the same factor every run)."""
    return tl.math.rsqrt(tl.sum(sums, axis=1) / num_cols + eps)


@triton.jit
def norm_row_scale(sum_squares_ptr, rows, row_mask, num_partials, num_cols, eps, PARTIALS: tl.constexpr):
    """rsqrt(mean(h^2) + eps) for each row of x whose RMSNorm the previous linear left
    pending (add_norm_store): load_norm_sums, then row_scale_of."""
    return row_scale_of(load_norm_sums(sum_squares_ptr, rows, row_mask, num_partials, PARTIALS), num_cols, eps)
