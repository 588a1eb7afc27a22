"""Triton helpers the weight-only kernels share: unpacking nibbles, loading x in pairs,
group scales, the split of K among programs and the output stores (with split K, the sum
of kvserve.ops.split_k)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.ops.pending_norm_tiles import add_norm_store
from kvserve.ops.split_k import arrives_last, rearm, store_summed_splits, summed_splits

# Split-K partials the word kernels' last split loads at once (summed_splits): all of an int4
# one-row call's (at most 8 splits). W2 int4 on an H200, GPU step 2.28 -> 2.26 ms (two
# rounds); llama3-8b's linears alone at one row (24 at once): q/o 6.7 -> 6.2 us, k/v 4.7 ->
# 4.1, down 15.5 -> 15.2. The mma.sync kernels load one at a time (unrolled by 4): fp8's
# one-row kernel with 8 at once, at the same 92 registers, made W2 fp8 slower (2.74 -> 2.83),
# and int4's took more registers (one row 128 -> 138).
WORD_SPLITS_IN_FLIGHT: tl.constexpr = tl.constexpr(8)


@triton.jit
def nibble(w, i: tl.constexpr, one_bits):
    """Nibble i of int32 words (k = 8 j + i) as the fp32 1 + q / 128: q goes into the top
    mantissa bits of 1.0f, so no int-to-float conversion; its products with bf16 or fp16
    values are exact in fp32."""
    return (((w >> (4 * i)) & 15) << 16 | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def load_x_pair_raw(x_ptrs, pair: tl.constexpr, mask, X_BF16: tl.constexpr):
    """x_ptrs[2 pair] and x_ptrs[2 pair + 1] as stored: a bf16 pair as one int32 load, other
    dtypes as an (even, odd) tuple. widen_x_pair makes them fp32 where they are used, so a
    load issued a tile ahead is not waited for at once."""
    if X_BF16:
        return tl.load(x_ptrs.to(tl.pointer_type(tl.int32)) + pair, mask=mask, other=0)
    else:
        return (tl.load(x_ptrs + 2 * pair, mask=mask, other=0.0), tl.load(x_ptrs + 2 * pair + 1, mask=mask, other=0.0))


@triton.jit
def widen_x_pair(pair, X_BF16: tl.constexpr):
    """A pair of load_x_pair_raw as fp32 (even, odd); bf16 widens by moving bits."""
    if X_BF16:
        return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)
    else:
        return pair[0].to(tl.float32), pair[1].to(tl.float32)


@triton.jit
def load_x_pair(x_ptrs, pair: tl.constexpr, mask, X_BF16: tl.constexpr):
    """x_ptrs[2 pair] and x_ptrs[2 pair + 1] in fp32."""
    return widen_x_pair(load_x_pair_raw(x_ptrs, pair, mask, X_BF16), X_BF16)


@triton.jit
def load_x_words(x_ptrs, mask, X_BF16: tl.constexpr):
    """The 8 values of x at x_ptrs[0..7] as 4 pairs of load_x_pair_raw."""
    return (load_x_pair_raw(x_ptrs, 0, mask, X_BF16), load_x_pair_raw(x_ptrs, 1, mask, X_BF16),
            load_x_pair_raw(x_ptrs, 2, mask, X_BF16), load_x_pair_raw(x_ptrs, 3, mask, X_BF16))


@triton.jit
def group_scale_offset(scale_ptrs, offset_ptrs, group, mask, HAS_OFFSET: tl.constexpr):
    """128 scale and offset - 128 scale of the groups at scale_ptrs + group (the values
    are f = 1 + q / 128)."""
    scale = 128.0 * tl.load(scale_ptrs + group, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        return scale, tl.load(offset_ptrs + group, mask=mask, other=0.0).to(tl.float32) - scale
    else:
        return scale, -scale


@triton.jit
def split_tiles(num_tiles, tiles_per_split, EVEN_SPLITS: tl.constexpr):
    """This program's K tiles first..last (grid axis 2: the splits of K): runs of
    tiles_per_split with the remainder in the last split, or (EVEN_SPLITS) runs as even as
    they go, the longer ones first (LaunchConfig.even_splits)."""
    split = tl.program_id(2)
    if EVEN_SPLITS:
        shorter = num_tiles // tl.num_programs(2)
        longer_runs = num_tiles - shorter * tl.num_programs(2)
        first = split * shorter + tl.minimum(split, longer_runs)
        last = first + shorter + (split < longer_runs).to(tl.int32)
    else:
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, num_tiles)
    return first, last


@triton.jit
def program_block(M, N, num_tiles, tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVEN_SPLITS: tl.constexpr):
    """This program's rows of x and output columns (grid: column blocks, row blocks,
    splits of K) with their masks, and its K tiles first..last."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first, last = split_tiles(num_tiles, tiles_per_split, EVEN_SPLITS)
    return rows, cols, rows < M, cols < N, first, last


@triton.jit
def dot_tile_pointers(x_ptr, w_ptr, rows, cols, row_mask, col_mask, first, stride_xm, stride_wn,
                       WORDS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tensor-core kernels' first tile: [BLOCK_N, WORDS] weight words and the
    transposed [BLOCK_K, BLOCK_M] x, with their masks."""
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (first * WORDS + tl.arange(0, WORDS)[None, :])
    x_ptrs = x_ptr + rows[None, :] * stride_xm + (first * BLOCK_K + tl.arange(0, BLOCK_K)[:, None])
    return w_ptrs, col_mask[:, None], x_ptrs, row_mask[None, :]


@triton.jit
def store_output(accs, offss, masks, partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT: tl.constexpr,
                 IN_FLIGHT: tl.constexpr = 1):
    """The program's blocks (tuples of values, offsets and masks) into out, or with split K
    their partials, summed by the last split to finish (summed_splits' IN_FLIGHT)."""
    if SPLIT:
        store_summed_splits(accs, partial_ptr, out_ptr, count_ptr, offss, masks, stride_ps, IN_FLIGHT)
    else:
        for i in tl.static_range(len(accs)):
            tl.store(out_ptr + offss[i], accs[i].to(out_ptr.dtype.element_ty), mask=masks[i])


@triton.jit
def store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Write the program's block of y ([cols, rows] when TRANSPOSED), or with split K its
    partial, summed by the last split to finish."""
    if TRANSPOSED:
        offs = rows[None, :] * stride_om + cols[:, None]
        mask = row_mask[None, :] & col_mask[:, None]
    else:
        offs = rows[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
    store_output((acc,), (offs,), (mask,), partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT, WORD_SPLITS_IN_FLIGHT)


@triton.jit
def store_block_add_norm(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                         residual_ptr, norm_weight_ptr, sum_squares_ptr, SPLIT: tl.constexpr):
    """store_block for a [rows, cols] block whose linear is followed by a residual add and an
    RMSNorm: add_norm_store on the block's final values (with split K, by its last split)."""
    if SPLIT:
        offs = rows[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        if arrives_last((y,), partial_ptr, count_ptr, (offs,), (mask,), stride_ps):
            total = summed_splits(partial_ptr, offs, mask, stride_ps, WORD_SPLITS_IN_FLIGHT)
            add_norm_store(total, rows, cols, row_mask, col_mask, out_ptr, stride_om, residual_ptr, norm_weight_ptr,
                           sum_squares_ptr)
            rearm(count_ptr)
    else:
        add_norm_store(y, rows, cols, row_mask, col_mask, out_ptr, stride_om, residual_ptr, norm_weight_ptr,
                       sum_squares_ptr)
