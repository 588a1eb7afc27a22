"""Weight-only matmul on the GPU for the quantized layers: y = x @ W^T with W read in its
stored form (int8, 4-bit nibble pairs or float8_e4m3fn) and scaled in the loop, so a
decode step moves the packed bytes once instead of a dequantized copy.

W[n, k] = q[n, k] * scale[n, g] + offset[n, g] with g = k // group_size (per-channel:
one group per row). q converts exactly to the activation dtype (|int8| <= 128, nibbles,
e4m3 values are all bf16/fp16 numbers), so each tile's product runs on tensor cores in
fp32 accumulation (a single row of fp8 weights: on the CUDA cores instead) and the
group's scale (and offset * sum(x)) is applied to the tile's partial sum afterwards. Up
to 16 rows pad to one 16-row tile (reads W once); split-K over fixed fp32 partials,
summed in a fixed order, fills the GPU when N is small. No host syncs and only
shape-dependent allocations: the launches are CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Row counts up to this run the decode configuration (one padded 16-row tile).
SMALL_ROWS = 16


@triton.jit
def _weight_only_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, group_size, tiles_per_split,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    FOUR_BIT: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    # Stored elements per tile along K: a byte holds two 4-bit values (k even: low nibble).
    PACK: tl.constexpr = 2 if FOUR_BIT else 1
    STORED_K: tl.constexpr = BLOCK_K // PACK
    kk = tl.arange(0, STORED_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    act = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        stored = k0 // PACK + kk
        # The tile as tl.dot wants it, [K, N]. (4-bit weights always come in whole tiles, so
        # `stored < K` only ever masks 8-bit K.)
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + stored[:, None]
        w_mask = col_mask[None, :] if EVEN_K else col_mask[None, :] & (stored[:, None] < K)
        w = tl.load(w_ptrs, mask=w_mask, other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        if FOUR_BIT:
            x_even = tl.load(x_rows + (k0 + 2 * kk)[None, :], mask=row_mask[:, None], other=0.0)
            x_odd = tl.load(x_rows + (k0 + 2 * kk + 1)[None, :], mask=row_mask[:, None], other=0.0)
            partial = tl.dot(x_even, (w & 15).to(act)) + tl.dot(x_odd, (w >> 4).to(act))
            tile_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
        else:
            k_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & ((k0 + kk) < K)[None, :]
            x = tl.load(x_rows + (k0 + kk)[None, :], mask=k_mask, other=0.0)
            partial = tl.dot(x, w.to(act))
            tile_sum = tl.sum(x.to(tl.float32), axis=1)
        if GROUPED:
            group = k0 // group_size
            scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
            acc += partial * scale[None, :]
            if HAS_OFFSET:
                offset = tl.load(offset_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
                acc += tile_sum[:, None] * offset[None, :]
        else:
            acc += partial
            x_sum += tile_sum
    if not GROUPED:
        acc *= tl.load(scale_ptr + cols * stride_sn, mask=col_mask, other=0.0)[None, :]
        if HAS_OFFSET:
            acc += x_sum[:, None] * tl.load(offset_ptr + cols * stride_sn, mask=col_mask, other=0.0)[None, :]
    out = out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _weight_only_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr,
    N, K, group_size, tiles_per_split,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    FOUR_BIT: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One row of x per program: W tiles [BLOCK_N, BLOCK_K] read as stored and multiplied on
    the CUDA cores into an fp32 accumulator of the same shape, reduced once at the end (no
    tensor-core operand layout, no per-tile reduction): the decode-at-batch-1 form."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    PACK: tl.constexpr = 2 if FOUR_BIT else 1
    STORED_K: tl.constexpr = BLOCK_K // PACK
    kk = tl.arange(0, STORED_K)
    x_row = x_ptr + row * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn

    acc = tl.zeros((BLOCK_N, STORED_K), dtype=tl.float32)
    offset_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_total = tl.zeros((STORED_K,), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        stored = k0 // PACK + kk
        if EVEN_K:
            w = tl.load(w_rows + stored[None, :], mask=col_mask[:, None], other=0)
        else:
            w = tl.load(w_rows + stored[None, :], mask=col_mask[:, None] & (stored[None, :] < K), other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        if FOUR_BIT:
            x_even = tl.load(x_row + k0 + 2 * kk).to(tl.float32)
            x_odd = tl.load(x_row + k0 + 2 * kk + 1).to(tl.float32)
            product = (w & 15).to(tl.float32) * x_even[None, :] + (w >> 4).to(tl.float32) * x_odd[None, :]
            x_tile = x_even + x_odd
        else:
            if EVEN_K:
                x_tile = tl.load(x_row + k0 + kk).to(tl.float32)
            else:
                x_tile = tl.load(x_row + k0 + kk, mask=(k0 + kk) < K, other=0.0).to(tl.float32)
            product = w.to(tl.float32) * x_tile[None, :]
        if GROUPED:
            group = k0 // group_size
            acc += product * tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)[:, None]
            if HAS_OFFSET:
                offset = tl.load(offset_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
                offset_acc += tl.sum(x_tile, axis=0) * offset
        else:
            acc += product
            x_total += x_tile
    y = tl.sum(acc, axis=1)
    if GROUPED:
        y += offset_acc
    else:
        y *= tl.load(scale_ptr + cols * stride_sn, mask=col_mask, other=0.0)
        if HAS_OFFSET:
            y += tl.sum(x_total, axis=0) * tl.load(offset_ptr + cols * stride_sn, mask=col_mask, other=0.0)
    tl.store(out_ptr + split * stride_os + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 2  # split K until about this many programs per SM
    split_k: int | None = None  # fixed split (tests); None: from `waves` on CUDA, else 1
    # block_m 1: the CUDA-core kernel, one row per program (reads W once per row).


def default_config(rows: int, four_bit: bool, fp8: bool) -> LaunchConfig:
    """Picked from llama3-8b's linears on an H200 (BENCHMARKS.md): at one row the CUDA-core
    kernel beats tl.dot tiles for fp8 weights (3.10 against 4.24 ms per step's linears),
    not for int8 (3.88 against 3.47) or int4 (even)."""
    if rows == 1 and fp8:
        return LaunchConfig(1, 32, 256)
    if rows <= SMALL_ROWS:
        return LaunchConfig(16, 128, 128) if four_bit else LaunchConfig(16, 64, 128)
    return LaunchConfig(64, 128, 64)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_k(config: LaunchConfig, in_features: int, group_size: int, grouped: bool, four_bit: bool) -> int | None:
    """The K tile: within one group when grouped (halved until it divides the group size),
    at least 16 stored elements (tl.dot's minimum); None when no tile fits."""
    block_k = config.block_k
    if grouped:
        while block_k > 16 and group_size % block_k:
            block_k //= 2
        if group_size % block_k:
            return None
    if block_k // (2 if four_bit else 1) < 16:
        return None
    return block_k


def weight_only_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_size: int, four_bit: bool = False, config: LaunchConfig | None = None,
) -> torch.Tensor | None:
    """x [..., K] (bf16/fp16; fp32 too under the interpreter) times the quantized weight.
    qweight [N, K] int8 / float8_e4m3fn, or uint8 [N, K / 2] nibble pairs (four_bit);
    scale and offset fp32 [N, K / group_size]. None where the kernel does not apply (odd
    K for 4-bit, groups narrower than a tile): the caller dequantizes instead."""
    in_features = x.shape[-1]
    n = qweight.shape[0]
    if four_bit and in_features % 2:
        return None
    grouped = scale.shape[1] > 1
    fp8 = qweight.dtype == torch.float8_e4m3fn
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    config = config or default_config(m, four_bit, fp8)
    block_k = _block_k(config, in_features, group_size, grouped, four_bit)
    if block_k is None or (four_bit and in_features % block_k):
        return None
    num_tiles = triton.cdiv(in_features, block_k)
    programs = triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m)
    split = config.split_k or 1
    if config.split_k is None and x.is_cuda:
        split = max(1, min(num_tiles, triton.cdiv(config.waves * _num_sms(x.device.index or 0), programs)))
    tiles_per_split = triton.cdiv(num_tiles, split)
    split = triton.cdiv(num_tiles, tiles_per_split)
    # e4m3 weights go in as their uint8 bits: masked lanes then load as +0.0, never a NaN.
    weight = qweight.view(torch.uint8) if fp8 else qweight
    # Split-K partials stay fp32 and are summed in one fixed order (deterministic).
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if m and config.block_m == 1:
        _weight_only_gemv_kernel[(triton.cdiv(n, config.block_n), m, split)](
            rows, weight, scale, offset if offset is not None else scale, out,
            n, in_features, group_size, tiles_per_split,
            rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
            FOUR_BIT=four_bit, FP8=fp8, GROUPED=grouped, HAS_OFFSET=offset is not None,
            EVEN_K=in_features % block_k == 0, BLOCK_N=config.block_n, BLOCK_K=block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    elif m:
        _weight_only_matmul_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)](
            rows, weight, scale, offset if offset is not None else scale, out,
            m, n, in_features, group_size, tiles_per_split,
            rows.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
            FOUR_BIT=four_bit, FP8=fp8, GROUPED=grouped, HAS_OFFSET=offset is not None,
            EVEN_K=in_features % block_k == 0,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    y = out[0] if split == 1 else out.sum(0).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)
