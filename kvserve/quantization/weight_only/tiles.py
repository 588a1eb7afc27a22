"""Triton helpers the weight-only kernels share: unpacking nibbles, loading x in pairs,
group scales, the split of K among programs and the output stores (the in-kernel split-K
sum)."""

from __future__ import annotations

import triton
import triton.language as tl


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
def _store_summed_splits(accs, partial_ptr, out_ptr, count_ptr, offss, masks, stride_ps):
    """Split-K without a second kernel: every split leaves its fp32 partials (a tuple of
    blocks, one counter for them all), and the last of an output tile's splits to arrive (an
    acq_rel counter) sums them all in split order (deterministic), writes the output and
    re-arms the counter for the next launch."""
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    counter = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    for i in tl.static_range(len(accs)):
        tl.store(partial_ptr + split * stride_ps + offss[i], accs[i], mask=masks[i])
    tl.debug_barrier()  # every thread's partial is written before thread 0 releases them
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        for i in tl.static_range(len(accs)):
            total = tl.zeros_like(accs[i])
            for s in range(num_splits):
                total += tl.load(partial_ptr + s * stride_ps + offss[i], mask=masks[i], other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + offss[i], total.to(out_ptr.dtype.element_ty), mask=masks[i])
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def split_tiles(num_tiles, tiles_per_split):
    """This program's K tiles first..last (grid axis 2: the splits of K)."""
    first = tl.program_id(2) * tiles_per_split
    return first, tl.minimum(first + tiles_per_split, num_tiles)


@triton.jit
def program_block(M, N, num_tiles, tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows of x and output columns (grid: column blocks, row blocks,
    splits of K) with their masks, and its K tiles first..last."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first, last = split_tiles(num_tiles, tiles_per_split)
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
def store_output(accs, offss, masks, partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT: tl.constexpr):
    """The program's blocks (tuples of values, offsets and masks) into out, or with split K
    their partials, summed by the last split to finish."""
    if SPLIT:
        _store_summed_splits(accs, partial_ptr, out_ptr, count_ptr, offss, masks, stride_ps)
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
    store_output((acc,), (offs,), (mask,), partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT)
