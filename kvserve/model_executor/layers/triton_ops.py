"""Fused elementwise kernels for the GPU path: residual add + RMSNorm, RoPE on q and k in
place, SiLU-and-mul. Unfused, these are about 30 small kernels per decoder layer, which at
decode batch sizes cost more device time than the matmuls of a small model.

Each kernel reproduces the torch path's roundings (the run dtype after the same
operations), so greedy output does not depend on which path ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve import dependent_launch


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, num_cols, stride_x, stride_r, stride_o, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    dependent_launch.chained(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the run dtype first, as `residual + x` would be.
        x = (x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)).to(
            x_ptr.dtype.element_ty
        )
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / num_cols
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm(x) or, with residual: residual += x in place, then RMSNorm(residual).
    x, residual: [T, hidden] with unit column stride."""
    num_rows, num_cols = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(num_cols)
    _add_rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, num_cols, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        **dependent_launch.chained_options(x.device),
    )
    return out


@triton.jit
def rope_factor(ptrs, dtype: tl.constexpr):
    """cos or sin values (fp32 in memory) cast to the run dtype, as the torch path does."""
    return tl.load(ptrs).to(dtype).to(tl.float32)


@triton.jit
def rotate_pair(x, partner, cos, signed_sin, dtype: tl.constexpr):
    """RoPE of x given its rotate_half partner: x cos + partner (+-sin), each product rounded
    to the run dtype as in the torch path (x1 cos - x2 sin for the first half, x2 cos + x1 sin
    for the second); the result in the run dtype."""
    return ((x.to(tl.float32) * cos).to(dtype).to(tl.float32)
            + (partner.to(tl.float32) * signed_sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, num_heads, stride_t, stride_h, stride_cs,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    dependent_launch.chained(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    dtype = x_ptr.dtype.element_ty
    cos = rope_factor(cos_ptr + token * stride_cs + dims, dtype)
    sin = rope_factor(sin_ptr + token * stride_cs + dims, dtype)
    first = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    tl.store(first, rotate_pair(x1, x2, cos, -sin, dtype), mask=mask)
    tl.store(first + HALF, rotate_pair(x2, x1, cos, sin, dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by cos/sin [T, head_dim / 2] (fp32)."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, cos, sin, num_heads, x.stride(0), x.stride(1), cos.stride(0),
            HALF=head_dim // 2, HEADS_PAD=triton.next_power_of_2(num_heads),
            **dependent_launch.chained_options(x.device),
        )
    return x


def rotary_queries_and_keys_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE on query [T, H, D] and key [T, KVH, D] in place: one launch where the key's heads
    directly follow the query's (views of the fused q/k/v projection), else one each."""
    # (A one-token view's first stride is whatever view() gave it: it is never stepped.)
    same_strides = key.stride()[1:] == query.stride()[1:] and (query.shape[0] == 1 or key.stride(0) == query.stride(0))
    adjacent = (key.dtype == query.dtype and same_strides and key.stride(-1) == 1
                and key.data_ptr() == query.data_ptr() + query.shape[1] * query.stride(1) * query.element_size())
    if adjacent:
        rotary_(torch.as_strided(query, (query.shape[0], query.shape[1] + key.shape[1], query.shape[2]),
                                 query.stride()), cos, sin)
    else:
        rotary_(query, cos, sin)
        rotary_(key, cos, sin)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    dependent_launch.chained(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim of [T, 2 * width] -> silu(gate) * up."""
    num_rows, double_width = x.shape
    width = double_width // 2
    assert x.stride(-1) == 1
    out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    if num_rows:
        block = 1024
        _silu_and_mul_kernel[(num_rows, triton.cdiv(width, block))](
            x, out, width, x.stride(0), out.stride(0), BLOCK=block,
            **dependent_launch.chained_options(x.device),
        )
    return out
