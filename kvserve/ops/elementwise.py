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

from kvserve.ops import pdl
from kvserve.ops.quant.fp8_activation import FP8_MAX, quantize_row
from kvserve.ops.quant.fp8_rows import Fp8Rows

_E4M3_MAX = tl.constexpr(FP8_MAX)  # a global a kernel reads must be constexpr


@triton.jit
def _store_row(out_ptr, scale_ptr, row, cols, mask, y, stride_o, FP8: tl.constexpr):
    """A kernel's output row y (fp32, already rounded to the run dtype): stored in the output's
    dtype, or with FP8 quantized (Fp8Rows: out_ptr a uint8 view of the e4m3 values)."""
    if FP8:
        bits, scale = quantize_row(y, _E4M3_MAX)
        tl.store(out_ptr + row * stride_o + cols, bits, mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, num_cols, stride_x, stride_r, stride_o, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl.chained(PDL)
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
    if FP8:  # the rows as the unfused kernel would store them
        out = out.to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_row(out_ptr, scale_ptr, row, cols, mask, out, stride_o, FP8)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, fp8: bool = False,
) -> torch.Tensor | Fp8Rows:
    """RMSNorm(x) or, with residual: residual += x in place, then RMSNorm(residual).
    x, residual: [T, hidden] with unit column stride. fp8: the output as Fp8Rows (for a
    weight no wider than x's dtype, whose output is in x's dtype)."""
    num_rows, num_cols = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if fp8:
        _check_fp8_rows(x.dtype, out_dtype)
    out, scales = _outputs(x, num_cols, out_dtype, fp8)
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        _add_rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, scales, num_cols, x.stride(0),
            residual.stride(0) if residual is not None else 0, num_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, FP8=fp8, num_warps=min(max(block // 256, 1), 16),
            **pdl.chained_options(x.device),
        )
    return Fp8Rows(out.view(torch.float8_e4m3fn), scales, x.dtype) if fp8 else out


@triton.jit
def _qk_rms_norm_kernel(heads_ptr, q_weight_ptr, k_weight_ptr, num_q_heads, head_dim, stride_t, stride_h, eps,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One head of one token normalized in place, with q's weight for the first num_q_heads
    heads and k's for the rest."""
    pdl.chained(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    ptrs = heads_ptr + token * stride_t + head * stride_h + cols
    xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / head_dim
    normed = (xf * tl.math.rsqrt(variance + eps)).to(heads_ptr.dtype.element_ty)
    if head < num_q_heads:
        weight = tl.load(q_weight_ptr + cols, mask=mask, other=0.0)
    else:
        weight = tl.load(k_weight_ptr + cols, mask=mask, other=0.0)
    tl.store(ptrs, (weight.to(tl.float32) * normed.to(tl.float32)).to(heads_ptr.dtype.element_ty), mask=mask)


def qk_rms_norm_(heads: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorms of queries and keys in one launch, in place: heads [T, q heads
    + kv heads, head_dim] (a view of the fused projection: unit stride along head_dim, q's
    heads first), each head normalized as RMSNorm does (fp32 sums, rounded to the run dtype,
    times its weight: q_weight for the first num_q_heads heads, k_weight after)."""
    num_tokens, num_heads, head_dim = heads.shape
    assert heads.stride(2) == 1 and q_weight.dtype == k_weight.dtype == heads.dtype
    if num_tokens:
        _qk_rms_norm_kernel[(num_tokens, num_heads)](
            heads, q_weight, k_weight, num_q_heads, head_dim, heads.stride(0), heads.stride(1), eps,
            BLOCK=triton.next_power_of_2(head_dim), num_warps=1, **pdl.chained_options(heads.device))
    return heads


def _check_fp8_rows(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    # fp32 rows differed from the unfused kernel's in a few values on an H100 (only the
    # 16-bit forms were checked to match bit for bit), and the fp8 linears take 16-bit rows.
    if dtype not in (torch.bfloat16, torch.float16) or out_dtype != dtype:
        raise ValueError(f"fp8 rows are quantized from bf16 or fp16 rows with an output of the same "
                         f"dtype, got {dtype} rows with a {out_dtype} output")


def _outputs(x: torch.Tensor, num_cols: int, dtype: torch.dtype, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's [T, num_cols] output (fp8: its uint8 bits) and, with fp8, its row scales
    (else a placeholder)."""
    if not fp8:
        return torch.empty(x.shape[0], num_cols, dtype=dtype, device=x.device), x
    out = torch.empty(x.shape[0], num_cols, dtype=torch.uint8, device=x.device)
    return out, torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)


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
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl.chained(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    dtype = x_ptr.dtype.element_ty
    if HALF_PAD == HALF:
        mask = heads < num_heads
        cos = rope_factor(cos_ptr + token * stride_cs + dims, dtype)
        sin = rope_factor(sin_ptr + token * stride_cs + dims, dtype)
    else:  # a half that is not a power of two (a vision tower's head_dim 80)
        mask = (heads < num_heads) & (dims < HALF)
        cos = tl.load(cos_ptr + token * stride_cs + dims, mask=dims < HALF, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_cs + dims, mask=dims < HALF, other=0.0).to(dtype).to(tl.float32)
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
            HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
            HEADS_PAD=triton.next_power_of_2(num_heads),
            **pdl.chained_options(x.device),
        )
    return x


def rotary_queries_and_keys_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE on query [T, H, D] and key [T, KVH, D] in place: one launch where the key's heads
    directly follow the query's (views of the fused q/k/v projection), else one each."""
    # (A one-token view's first stride is whatever view() gave it: it is never stepped.)
    same_strides = key.stride()[1:] == query.stride()[1:] and (query.shape[0] == 1 or key.stride(0) == query.stride(0))
    # Views of one storage only: two tensors the allocator happened to place back to back
    # are adjacent in memory but not one tensor's view.
    adjacent = (key.dtype == query.dtype and same_strides and key.stride(-1) == 1
                and key.untyped_storage().data_ptr() == query.untyped_storage().data_ptr()
                and key.data_ptr() == query.data_ptr() + query.shape[1] * query.stride(1) * query.element_size())
    if adjacent:
        rotary_(torch.as_strided(query, (query.shape[0], query.shape[1] + key.shape[1], query.shape[2]),
                                 query.stride()), cos, sin)
    else:
        rotary_(query, cos, sin)
        rotary_(key, cos, sin)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, scale_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl.chained(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    _store_row(out_ptr, scale_ptr, row, cols, mask, (act * up).to(dtype).to(tl.float32), stride_o, FP8)


def silu_and_mul(x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
    """x = [gate | up] along the last dim of [T, 2 * width] -> silu(gate) * up (fp8: as
    Fp8Rows, a whole row per program)."""
    num_rows, double_width = x.shape
    width = double_width // 2
    assert x.stride(-1) == 1
    if fp8:
        _check_fp8_rows(x.dtype, x.dtype)
    out, scales = _outputs(x, width, x.dtype, fp8)
    if num_rows:
        block = triton.next_power_of_2(width) if fp8 else 1024
        _silu_and_mul_kernel[(num_rows, triton.cdiv(width, block))](
            x, out, scales, width, x.stride(0), width, BLOCK=block, FP8=fp8,
            num_warps=min(max(block // 1024, 4), 16),
            **pdl.chained_options(x.device),
        )
    return Fp8Rows(out.view(torch.float8_e4m3fn), scales, x.dtype) if fp8 else out
