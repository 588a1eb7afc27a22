"""Scatter one step's new K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops import pdl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    inv_k_scale,
    inv_v_scale,
    FP8_MAX: tl.constexpr,  # > 0: a float8 cache, values scaled and saturated to it
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.chained(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (e.g. a CUDA-graph bucket's spare rows).
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < num_kv_heads
    cache_offsets = slot * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """key, value: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D], its slots
    contiguous so that flat slot s sits at s * KVH * D within each half."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert kv_cache[0].is_contiguous(), "the KV cache halves must be contiguous"
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        FP8_MAX=torch.finfo(kv_cache.dtype).max if kv_cache.dtype.itemsize == 1 else 0.0,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        **pdl.chained_options(key.device),
    )
