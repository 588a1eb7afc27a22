"""The kernels any stored form takes (int8, nibble pairs, e4m3 bytes), one element a load:
tl.dot tiles for several rows and a CUDA-core loop for one row. int8 weights always run
here; 4-bit and fp8 weights where the word kernels do not apply."""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.ops.pending_norm_tiles import norm_row_scale


@triton.jit
def weight_only_matmul_kernel(
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
def weight_only_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr, pending_ptr,
    N, K, group_size, tiles_per_split,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om, pending_partials, norm_eps,
    FOUR_BIT: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
    ROW_SCALE: tl.constexpr, PARTIALS: tl.constexpr,
):
    """One row of x per program: W tiles [BLOCK_N, BLOCK_K] read as stored and multiplied on
    the CUDA cores into an fp32 accumulator of the same shape, reduced once at the end (no
    tensor-core operand layout, no per-tile reduction): the decode-at-batch-1 form.
    ROW_SCALE: x's RMSNorm was left pending by the previous linear (PendingNorm); the output
    row is scaled by its rsqrt(mean(h^2) + eps), read after the loop."""
    if LAUNCH_NEXT:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
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
    if ROW_SCALE:
        this_row = row + tl.zeros((1,), dtype=tl.int64)
        y *= tl.sum(norm_row_scale(pending_ptr, this_row, this_row >= 0, pending_partials, K, norm_eps, PARTIALS))
    tl.store(out_ptr + split * stride_os + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)
