"""Scatter one step's new K/V rows into their paged-cache slots, optionally applying RoPE
to the queries and keys on the way (one kernel where rotary + write took two)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve import dependent_launch
from kvserve.model_executor.layers.triton_ops import load_cos_sin, rotate_half, rotate_heads_


@triton.jit
def _scale_to_cache(x, inv_scale, FP8_MAX: tl.constexpr):
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    return x


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    query_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cache_slot,
    stride_cache_head,
    inv_k_scale,
    inv_v_scale,
    FP8_MAX: tl.constexpr,  # > 0: a float8 cache, values scaled and saturated to it
    ROTARY: tl.constexpr,  # rotate the queries in place and the keys before they are stored
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_launch.chained(PDL)
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    if ROTARY:
        half_dims = tl.arange(0, HALF)[None, :]
        cos, sin = load_cos_sin(cos_ptr, sin_ptr, token, stride_cs, half_dims, query_ptr.dtype.element_ty)
        rotate_heads_(query_ptr, token, num_heads, stride_qt, stride_qh, cos, sin, half_dims, HALF, HEADS_PAD)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (e.g. a CUDA-graph bucket's spare rows).
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    mask = heads < num_kv_heads
    cache_heads = slot * stride_cache_slot + heads * stride_cache_head
    cache_dtype = k_cache_ptr.dtype.element_ty
    if ROTARY:
        first = key_ptr + token * stride_kt + heads * stride_kh + half_dims
        k1, k2 = rotate_half(tl.load(first, mask=mask), tl.load(first + HALF, mask=mask), cos, sin,
                             key_ptr.dtype.element_ty)
        k_first = k_cache_ptr + cache_heads + half_dims
        tl.store(k_first, _scale_to_cache(k1, inv_k_scale, FP8_MAX).to(cache_dtype), mask=mask)
        tl.store(k_first + HALF, _scale_to_cache(k2, inv_k_scale, FP8_MAX).to(cache_dtype), mask=mask)
    else:
        dims = tl.arange(0, HEAD_DIM)[None, :]
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + cache_heads + dims, _scale_to_cache(k, inv_k_scale, FP8_MAX).to(cache_dtype),
                 mask=mask)
    dims = tl.arange(0, HEAD_DIM)[None, :]
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + cache_heads + dims, _scale_to_cache(v, inv_v_scale, FP8_MAX).to(cache_dtype),
             mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    query: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """key, value: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D], its slots
    contiguous so that flat slot s sits at s * KVH * D within each half. With rotary =
    (cos, sin) [T, D / 2] fp32, the query [T, H, D] is rotated in place and the key is
    stored rotated (key itself is left as it was), as apply_rotary would round them."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert kv_cache[0].is_contiguous(), "the KV cache halves must be contiguous"
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    if num_tokens == 0:
        return
    if rotary is None:
        query, cos, sin, num_heads = key, key, key, 0  # unused
    else:
        assert query is not None and query.stride(-1) == 1
        cos, sin = rotary
        assert cos.stride() == sin.stride() and cos.stride(-1) == 1
        num_heads = query.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        query,
        cos,
        sin,
        num_heads,
        num_kv_heads,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        FP8_MAX=torch.finfo(kv_cache.dtype).max if kv_cache.dtype.itemsize == 1 else 0.0,
        ROTARY=rotary is not None,
        HEADS_PAD=triton.next_power_of_2(max(num_heads, 1)),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        **dependent_launch.chained_options(key.device),
    )
