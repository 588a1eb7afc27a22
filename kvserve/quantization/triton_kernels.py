"""Weight-only matmul on the GPU for the quantized layers: y = x @ W^T with W read in its
stored form (int8, 4-bit nibble pairs or float8_e4m3fn) and scaled in the loop, so a
decode step moves the packed bytes once instead of a dequantized copy.

W[n, k] = q[n, k] * scale[n, g] + offset[n, g] with g = k // group_size (per-channel:
one group per row). q converts exactly to the activation dtype (|int8| <= 128, nibbles,
e4m3 values are all bf16/fp16 numbers), so each tile's product runs on tensor cores in
fp32 accumulation (block_m 1: on the CUDA cores instead) and the group's scale (and
offset * sum(x)) is applied to the tile's partial sum afterwards. Up to 16 rows pad to one
16-row tile (reads W once); split-K over fixed fp32 partials, summed in a fixed order by
torch, fills the GPU when N is small. int8 weights, and fp8 rows that are not whole
tiles of K, always take these kernels.

4-bit weights at up to 64 rows (INT4_DECODE_CONFIGS) and fp8 weights at up to 16 rows
(FP8_DECODE_CONFIGS) take the int32-word kernels instead, multiplied on the CUDA cores
("fma", few rows) or on tensor cores ("dot": W x^T, a wgmma on sm_90). 4-bit: 8 nibbles a
load, each put into the mantissa of 1.0f by a shift and one LOP3 (f = 1 + q / 128, no
int-to-float conversion); 128 scale and (offset - 128 scale) * sum(x) apply per group, and
a tile may hold two groups (longer runs of each weight row per load). At 2-32 rows on CUDA,
4-bit weights go through mma.sync instead ("mma"): each thread builds its own tensor-core
A fragment from the words it loaded (two nibbles a LOP3, as bf16/fp16 magic + q), which
halves the instructions a weight against the CUDA-core loop and serves 8 rows of x for the
price of one; 9-32 rows take 2-4 such tiles of x against each fragment, unpacked once
(_int4_mma_kernel). fp8 weights likewise at 2-16 rows (_fp8_mma_kernel: e4m3 to fp16 by the
hardware, x's bf16 pairs to fp16, fp16 MMAs).
fp8: 4 e4m3 values a load, each byte converted by the hardware (exact); per-channel scales
apply once at the end, group scales once per tile. Their split-K partials are summed
inside the kernel, in split order, by the last split to finish: one launch per linear.

No host syncs and only shape-dependent allocations (the split counters are allocated once
per device, at the first call): the launches are CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve import dependent_launch

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
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    """One row of x per program: W tiles [BLOCK_N, BLOCK_K] read as stored and multiplied on
    the CUDA cores into an fp32 accumulator of the same shape, reduced once at the end (no
    tensor-core operand layout, no per-tile reduction): the decode-at-batch-1 form."""
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
    tl.store(out_ptr + split * stride_os + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _nibble(w, i: tl.constexpr, one_bits):
    """Nibble i of int32 words (k = 8 j + i) as the fp32 1 + q / 128: q goes into the top
    mantissa bits of 1.0f, so no int-to-float conversion; its products with bf16 or fp16
    values are exact in fp32."""
    return (((w >> (4 * i)) & 15) << 16 | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _load_x_pair_raw(x_ptrs, pair: tl.constexpr, mask, X_BF16: tl.constexpr):
    """x_ptrs[2 pair] and x_ptrs[2 pair + 1] as stored: a bf16 pair as one int32 load, other
    dtypes as an (even, odd) tuple. _widen_x_pair makes them fp32 where they are used, so a
    load issued a tile ahead is not waited for at once."""
    if X_BF16:
        return tl.load(x_ptrs.to(tl.pointer_type(tl.int32)) + pair, mask=mask, other=0)
    else:
        return (tl.load(x_ptrs + 2 * pair, mask=mask, other=0.0), tl.load(x_ptrs + 2 * pair + 1, mask=mask, other=0.0))


@triton.jit
def _widen_x_pair(pair, X_BF16: tl.constexpr):
    """A pair of _load_x_pair_raw as fp32 (even, odd); bf16 widens by moving bits."""
    if X_BF16:
        return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)
    else:
        return pair[0].to(tl.float32), pair[1].to(tl.float32)


@triton.jit
def _load_x_pair(x_ptrs, pair: tl.constexpr, mask, X_BF16: tl.constexpr):
    """x_ptrs[2 pair] and x_ptrs[2 pair + 1] in fp32."""
    return _widen_x_pair(_load_x_pair_raw(x_ptrs, pair, mask, X_BF16), X_BF16)


@triton.jit
def _load_x_words(x_ptrs, mask, X_BF16: tl.constexpr):
    """The 8 values of x at x_ptrs[0..7] as 4 pairs of _load_x_pair_raw."""
    return (_load_x_pair_raw(x_ptrs, 0, mask, X_BF16), _load_x_pair_raw(x_ptrs, 1, mask, X_BF16),
            _load_x_pair_raw(x_ptrs, 2, mask, X_BF16), _load_x_pair_raw(x_ptrs, 3, mask, X_BF16))


@triton.jit
def _group_scale_offset(scale_ptrs, offset_ptrs, group, mask, HAS_OFFSET: tl.constexpr):
    """128 scale and offset - 128 scale of the groups at scale_ptrs + group (the values
    are f = 1 + q / 128)."""
    scale = 128.0 * tl.load(scale_ptrs + group, mask=mask, other=0.0)
    if HAS_OFFSET:
        return scale, tl.load(offset_ptrs + group, mask=mask, other=0.0) - scale
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
def _split_tiles(num_tiles, tiles_per_split):
    """This program's K tiles first..last (grid axis 2: the splits of K)."""
    first = tl.program_id(2) * tiles_per_split
    return first, tl.minimum(first + tiles_per_split, num_tiles)


@triton.jit
def _program_block(M, N, num_tiles, tiles_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows of x and output columns (grid: column blocks, row blocks,
    splits of K) with their masks, and its K tiles first..last."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first, last = _split_tiles(num_tiles, tiles_per_split)
    return rows, cols, rows < M, cols < N, first, last


@triton.jit
def _dot_tile_pointers(x_ptr, w_ptr, rows, cols, row_mask, col_mask, first, stride_xm, stride_wn,
                       WORDS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tensor-core kernels' first tile: [BLOCK_N, WORDS] weight words and the
    transposed [BLOCK_K, BLOCK_M] x, with their masks."""
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (first * WORDS + tl.arange(0, WORDS)[None, :])
    x_ptrs = x_ptr + rows[None, :] * stride_xm + (first * BLOCK_K + tl.arange(0, BLOCK_K)[:, None])
    return w_ptrs, col_mask[:, None], x_ptrs, row_mask[None, :]


@triton.jit
def _store_output(accs, offss, masks, partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT: tl.constexpr):
    """The program's blocks (tuples of values, offsets and masks) into out, or with split K
    their partials, summed by the last split to finish."""
    if SPLIT:
        _store_summed_splits(accs, partial_ptr, out_ptr, count_ptr, offss, masks, stride_ps)
    else:
        for i in tl.static_range(len(accs)):
            tl.store(out_ptr + offss[i], accs[i].to(out_ptr.dtype.element_ty), mask=masks[i])


@triton.jit
def _store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Write the program's block of y ([cols, rows] when TRANSPOSED), or with split K its
    partial, summed by the last split to finish."""
    if TRANSPOSED:
        offs = rows[None, :] * stride_om + cols[:, None]
        mask = row_mask[None, :] & col_mask[:, None]
    else:
        offs = rows[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
    _store_output((acc,), (offs,), (mask,), partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    X_BF16: tl.constexpr, HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """4-bit weights as int32 words of 8 nibbles, unpacked with shifts and masks into fp32
    1 + q / 128 and multiplied on the CUDA cores against up to BLOCK_M rows of x:
    sum(W x) = 128 scale sum(f x) + (offset - 128 scale) sum(x) within each group.

    A tile lies within one group, or (TWO_GROUPS) holds two whole groups, its halves: a
    weight row is then read in runs of two groups' bytes (128 for 128-wide groups), which
    the DRAM serves faster than one group's 64. Everything a tile needs (its words, x,
    the groups' scales and offsets) is loaded one tile ahead; each thread keeps per-word
    partial sums, the scale applied lane by lane (one cross-thread reduction, at the end);
    the tiles advance scalar base pointers under fixed 32-bit offsets. With PDL the first
    tile's words and scales load before the wait for the previous kernel (dependent_launch)."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    rows, cols, row_mask, col_mask, first, last = _program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 8
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    words = tl.arange(0, WORDS)
    # [rows, cols, words] throughout: the weight load fixes the layout (4 words a thread,
    # every row of x in each thread), so nothing moves between threads inside the loop.
    w_offsets = cols[None, :, None] * stride_wn + words[None, None, :]
    w_tile = w_ptr + first * WORDS
    w_mask = col_mask[None, :, None]
    x_tile = x_ptr + rows[:, None, None] * stride_xm + (first * BLOCK_K + 8 * words[None, None, :])
    x_mask = row_mask[:, None, None]
    scale_ptrs = scale_ptr + cols * stride_sn
    offset_ptrs = offset_ptr + cols * stride_sn
    second_half = (words >= WORDS // 2)[None, None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
    # Weights are read once a step: evict_first keeps x, scales and partials in L2.
    w = tl.load(w_tile + w_offsets, mask=w_mask, other=0, eviction_policy="evict_first")
    group = first * TILE_GROUPS // tiles_per_group
    scale, offset = _group_scale_offset(scale_ptrs, offset_ptrs, group, col_mask, HAS_OFFSET)
    scale2, offset2 = _group_scale_offset(scale_ptrs, offset_ptrs, group + 1, col_mask & TWO_GROUPS, HAS_OFFSET)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x01, x23, x45, x67 = _load_x_words(x_tile, x_mask, X_BF16)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        x_next = _load_x_words(x_tile + BLOCK_K, x_mask & more, X_BF16)
        group = (tile + 1) * TILE_GROUPS // tiles_per_group
        scale_next, offset_next = _group_scale_offset(scale_ptrs, offset_ptrs, group, col_mask & more, HAS_OFFSET)
        scale2_next, offset2_next = _group_scale_offset(scale_ptrs, offset_ptrs, group + 1,
                                                        col_mask & more & TWO_GROUPS, HAS_OFFSET)
        f_x = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M, 1, WORDS), dtype=tl.float32)
        for pair in tl.static_range(4):
            x_even, x_odd = _widen_x_pair((x01, x23, x45, x67)[pair], X_BF16)
            f_x += _nibble(w, 2 * pair, one_bits) * x_even
            f_x += _nibble(w, 2 * pair + 1, one_bits) * x_odd
            x_sum += x_even + x_odd
        if TWO_GROUPS:
            acc += (f_x * tl.where(second_half, scale2[None, :, None], scale[None, :, None])
                    + x_sum * tl.where(second_half, offset2[None, :, None], offset[None, :, None]))
        else:
            acc += f_x * scale[None, :, None] + x_sum * offset[None, :, None]
        w, scale, offset, scale2, offset2 = w_next, scale_next, offset_next, scale2_next, offset2_next
        x01, x23, x45, x67 = x_next
        w_tile += WORDS
        x_tile += BLOCK_K
    _store_block(tl.sum(acc, axis=2), rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr,
                 stride_om, stride_ps, SPLIT, TRANSPOSED=False)


@triton.jit
def _unpack_words(w, one_bits, BLOCK_K: tl.constexpr):
    """[N, BLOCK_K / 8] int32 words to [N, BLOCK_K] fp32 1 + q / 128 in k order: nibble
    i = 4 a + 2 b + c of word j is k = 8 j + i, and each join adds the next of a, b, c as a
    new minor dimension."""
    h0 = tl.join(tl.join(_nibble(w, 0, one_bits), _nibble(w, 4, one_bits)),
                 tl.join(_nibble(w, 2, one_bits), _nibble(w, 6, one_bits)))
    h1 = tl.join(tl.join(_nibble(w, 1, one_bits), _nibble(w, 5, one_bits)),
                 tl.join(_nibble(w, 3, one_bits), _nibble(w, 7, one_bits)))
    return tl.join(h0, h1).reshape(w.shape[0], BLOCK_K)


@triton.jit
def _int4_dot_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The same words and 1 + q / 128 values on tensor cores, computed transposed (W x^T:
    the weight tile is the dot's M side, so on sm_90 it is a wgmma of BLOCK_N rows with
    BLOCK_M >= 16 padded rows of x as its N side). The values 1 + q / 128 are exact in
    bf16 and fp16."""
    rows, cols, row_mask, col_mask, first, last = _program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 8
    w_ptrs, w_mask, x_ptrs, x_mask = _dot_tile_pointers(x_ptr, w_ptr, rows, cols, row_mask, col_mask, first,
                                                        stride_xm, stride_wn, WORDS, BLOCK_K)
    act = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w = tl.load(w_ptrs, mask=w_mask, other=0)
    for tile in range(first, last):
        # The next tile's words are in flight while this one is multiplied.
        w_next = tl.load(w_ptrs + WORDS, mask=w_mask & (tile + 1 < last), other=0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        f_x = tl.dot(_unpack_words(w, one_bits, BLOCK_K).to(act), x)
        group = tile // tiles_per_group
        scale = 128.0 * tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
        offset = -scale
        if HAS_OFFSET:
            offset += tl.load(offset_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
        acc += f_x * scale[:, None] + tl.sum(x.to(tl.float32), axis=0)[None, :] * offset[:, None]
        w = w_next
        w_ptrs += WORDS
        x_ptrs += BLOCK_K
    _store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT, TRANSPOSED=True)


@triton.jit
def _mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FP16: tl.constexpr):
    """One warp-wide mma.sync m16n8k16 with fp32 accumulators: each thread passes its own
    fragment registers (A row-major, B column-major, as the PTX ISA lays them out), so the
    caller's per-thread tensors must hold element i in thread i."""
    if FP16:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _prmt(a, b, selector: tl.constexpr):
    """The bytes of (a, b) picked by `selector` (PTX prmt): two 16-bit halves into one word."""
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {selector};", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _nibble_pairs(w, i: tl.constexpr, magic):
    """Nibbles i and i + 4 of int32 words as a pair of 16-bit floats magic + q: the nibble
    in the low mantissa bits of 128 (bf16) or 1024 (fp16), exact. `magic` is a run-time
    value so that ptxas merges the mask and the OR into one LOP3."""
    return ((w >> (4 * i)) & 0x000F000F) | magic


@triton.jit
def _unstack4(t):
    """[..., 4] per-thread values as four [...] tensors, in order (register renames)."""
    a, b = tl.split(t.reshape(t.shape[:-1] + [2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _stack4(a, b, c, d):
    return tl.join(tl.join(a, b), tl.join(c, d)).reshape(a.shape + [4])


@triton.jit
def _mma_weight_rows(ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr):
    """Thread (g, t) of each warp (lane 4 g + t) as [threads] tensors, and its weight rows g
    and g + 8 of each of the warp's ROW_TILES 16-row tiles as [threads, ROW_TILES] tensors
    (thread i holds row i: Triton keeps such tensors in registers, no layout conversions)."""
    thread = tl.arange(0, 32 * NUM_WARPS)
    g = thread % 32 // 4
    w_row = (tl.program_id(0) * (16 * ROW_TILES * NUM_WARPS) + (thread // 32 * (16 * ROW_TILES) + g)[:, None]
             + 16 * tl.arange(0, ROW_TILES)[None, :])
    return g, thread % 4, w_row, w_row + 8


@triton.jit
def _mma_weight_pointers(w_ptr, w_row, t, stride_wn, N):
    """Thread (g, t)'s 16-byte loads of weight rows g and g + 8: words 4 t .. 4 t + 3 of a
    tile's first half (its second half is 16 words on), and which of the two rows exist
    (masks of the weight loads and of the rows' scales)."""
    w_g = (w_ptr + w_row[:, :, None].to(tl.int64) * stride_wn + (4 * t)[:, None, None]
           + tl.arange(0, 4)[None, None, :])
    return w_g, w_g + 8 * stride_wn, w_row < N, w_row + 8 < N


@triton.jit
def _mma_x_pairs(x_ptr, g, first_pair, stride_xm, M, X_TILES: tl.constexpr):
    """Thread (g, t)'s 16-byte loads of x row 8 j + g (B's column g of x tile j) as
    bf16/fp16 pairs, from pair `first_pair` of a tile on, masked past x's M rows: a tuple of
    (pointers, mask) for each of the X_TILES tiles of 8 rows."""
    pairs = (x_ptr.to(tl.pointer_type(tl.int32)) + (g * (stride_xm // 2) + first_pair)[:, None]
             + tl.arange(0, 4)[None, :])
    tiles = ()
    for j in tl.static_range(X_TILES):
        tiles = tiles + ((pairs + j * 4 * stride_xm, (g + 8 * j < M)[:, None]),)
    return tiles


@triton.jit
def _repeat(value, COUNT: tl.constexpr):
    """A tuple of COUNT copies of value: the mma kernels' accumulators, four an x tile (x tile
    j's are 4 j .. 4 j + 3)."""
    copies = ()
    for _ in tl.static_range(COUNT):
        copies = copies + (value,)
    return copies


@triton.jit
def _mma_weight_tile(w_g, w_g8, row_mask, row_mask8, words):
    """The two halves of a tile (first half, rows g and g + 8; then the second), `words` in:
    read once a step, so evict_first keeps x and the scales in L2."""
    w_mask = row_mask[:, :, None]
    w_mask8 = row_mask8[:, :, None]
    return (tl.load(w_g + words, mask=w_mask, other=0, eviction_policy="evict_first"),
            tl.load(w_g8 + words, mask=w_mask8, other=0, eviction_policy="evict_first"),
            tl.load(w_g + words + 16, mask=w_mask, other=0, eviction_policy="evict_first"),
            tl.load(w_g8 + words + 16, mask=w_mask8, other=0, eviction_policy="evict_first"))


@triton.jit
def _mma_store(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
               SPLIT: tl.constexpr, X_TILES: tl.constexpr):
    """Write thread (g, t)'s outputs: of x tile j, ys[4 j .. 4 j + 3] are weight rows g and
    g + 8 against x rows 8 j + 2 t and 8 j + 2 t + 1, the accumulators' layout of m16n8k16."""
    w_row8 = w_row + 8
    accs, offss, masks = (), (), ()
    for j in tl.static_range(X_TILES):
        x_row = (8 * j + 2 * t)[:, None]
        accs = accs + (_stack4(ys[4 * j], ys[4 * j + 1], ys[4 * j + 2], ys[4 * j + 3]),)
        offss = offss + (_stack4(x_row * stride_om + w_row, (x_row + 1) * stride_om + w_row,
                                 x_row * stride_om + w_row8, (x_row + 1) * stride_om + w_row8),)
        masks = masks + (_stack4((x_row < M) & (w_row < N), (x_row + 1 < M) & (w_row < N),
                                 (x_row < M) & (w_row8 < N), (x_row + 1 < M) & (w_row8 < N)),)
    _store_output(accs, offss, masks, partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT)


@triton.jit
def _int4_mma_tile_scales(scale_ptr, offset_ptr, w_row, w_row8, row_mask, row_mask8, stride_sn, tile, group_size,
                          HAS_OFFSET: tl.constexpr):
    """For each half of 256-k tile `tile`: the scales of weight rows g and g + 8 and (with
    HAS_OFFSET) their offsets, as stored. Loaded a tile ahead, like the words: they come from
    DRAM (a row's scales lie a row of groups apart), and nothing may wait on them early."""
    out = ()
    for h in tl.static_range(2):
        group = (tile * 256 + h * 128) // group_size
        out = out + (tl.load(scale_ptr + w_row * stride_sn + group, mask=row_mask, other=0.0),
                     tl.load(scale_ptr + w_row8 * stride_sn + group, mask=row_mask8, other=0.0))
        if HAS_OFFSET:
            out = out + (tl.load(offset_ptr + w_row * stride_sn + group, mask=row_mask, other=0.0),
                         tl.load(offset_ptr + w_row8 * stride_sn + group, mask=row_mask8, other=0.0))
    return out


@triton.jit
def _int4_mma_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, group_size, magic,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    FP16: tl.constexpr, HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr, ROW_TILES: tl.constexpr,
    NUM_WARPS: tl.constexpr, X_TILES: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    """Up to 8 X_TILES rows of x against ROW_TILES x 16 weight rows a warp on tensor cores,
    through mma.sync m16n8k16 (B's 8 columns are 8 rows of x; each A fragment, unpacked once,
    meets every x tile). Thread (g, t) of a warp (lane 4 g + t)
    unpacks its own A fragment from the stored words, one LOP3 a register (nibbles i and
    i + 4 of a word as magic + q), so the MMA's k order is a fixed permutation of K that x's
    B fragment follows (two PRMTs); magic * sum(x) comes back out with the offsets, whose
    sum(x) is the same MMA with a ones fragment. A tile is 256 k, two groups of 128: one
    16-byte load a weight row and group a thread, the next tile's (and its scales and
    offsets) in flight while this one is multiplied. Per-thread values are [threads,
    ROW_TILES] tensors (thread i holds row i), so Triton keeps them in registers with no
    layout conversions; an x tile's are a tuple."""
    if LAUNCH_NEXT:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    THREADS: tl.constexpr = 32 * NUM_WARPS
    ONES: tl.constexpr = 0x3C003C00 if FP16 else 0x3F803F80
    BIAS: tl.constexpr = 1024.0 if FP16 else 128.0
    g, t, w_row, w_row8 = _mma_weight_rows(ROW_TILES, NUM_WARPS)
    first, last = _split_tiles(num_tiles, tiles_per_split)
    # Thread (g, t) loads words 16 h + 4 t .. + 3 of weight rows g and g + 8 (of each row
    # tile) in half h of a tile, and x rows 8 j + g's bf16 pairs of the same words.
    w_g, w_g8, row_mask, row_mask8 = _mma_weight_pointers(w_ptr, w_row, t, stride_wn, N)
    x_tiles = _mma_x_pairs(x_ptr, g, 16 * t, stride_xm, M, X_TILES)
    ones = tl.full((THREADS,), ONES, dtype=tl.int32)
    zero = tl.zeros((THREADS, ROW_TILES), dtype=tl.float32)
    zero1 = tl.zeros((THREADS,), dtype=tl.float32)

    ys = _repeat(zero, 4 * X_TILES)
    w_tile = first * 32
    w_a, w_a8, w_b, w_b8 = _mma_weight_tile(w_g, w_g8, row_mask, row_mask8, w_tile)
    scales = _int4_mma_tile_scales(scale_ptr, offset_ptr, w_row, w_row8, row_mask, row_mask8, stride_sn,
                                   first, group_size, HAS_OFFSET)
    for tile in range(first, last):
        # The next tile in flight while this one is multiplied; the last loads itself again.
        next_a, next_a8, next_b, next_b8 = _mma_weight_tile(w_g, w_g8, row_mask, row_mask8,
                                                             w_tile + tl.where(tile + 1 < last, 32, 0))
        next_scales = _int4_mma_tile_scales(scale_ptr, offset_ptr, w_row, w_row8, row_mask, row_mask8,
                                            stride_sn, tl.minimum(tile + 1, last - 1), group_size, HAS_OFFSET)
        for h in tl.static_range(2):
            words = _unstack4(w_a if h == 0 else w_b)
            words8 = _unstack4(w_a8 if h == 0 else w_b8)
            cs = _repeat(zero, 4 * X_TILES)
            ss = _repeat(zero1, 4 * X_TILES)
            for word in tl.static_range(4):
                x_words = ()
                for j in tl.static_range(X_TILES):
                    x_pairs, x_mask = x_tiles[j]
                    x_words = x_words + _unstack4(tl.load(x_pairs + tile * 128 + h * 64 + 4 * word, mask=x_mask,
                                                          other=0))
                for half in tl.static_range(2):
                    a0 = _nibble_pairs(words[word], 2 * half, magic)
                    a1 = _nibble_pairs(words8[word], 2 * half, magic)
                    a2 = _nibble_pairs(words[word], 2 * half + 1, magic)
                    a3 = _nibble_pairs(words8[word], 2 * half + 1, magic)
                    new_cs, new_ss = (), ()
                    for j in tl.static_range(X_TILES):
                        # (x[8 w + 2 half], x[8 w + 2 half + 4]) and the next two, as the nibbles pair up.
                        xb0 = _prmt(x_words[4 * j + half], x_words[4 * j + half + 2], 0x5410)
                        xb1 = _prmt(x_words[4 * j + half], x_words[4 * j + half + 2], 0x7632)
                        new_cs = new_cs + _mma_m16n8k16(a0, a1, a2, a3, xb0[:, None], xb1[:, None], cs[4 * j],
                                                        cs[4 * j + 1], cs[4 * j + 2], cs[4 * j + 3], FP16)
                        new_ss = new_ss + _mma_m16n8k16(ones, ones, ones, ones, xb0, xb1, ss[4 * j],
                                                        ss[4 * j + 1], ss[4 * j + 2], ss[4 * j + 3], FP16)
                    cs, ss = new_cs, new_ss
            # The fragments hold BIAS + q: BIAS * scale comes off the offset.
            if HAS_OFFSET:
                scale, scale8, offset, offset8 = scales[4 * h: 4 * h + 4]
                offset, offset8 = offset - BIAS * scale, offset8 - BIAS * scale8
            else:
                scale, scale8 = scales[2 * h: 2 * h + 2]
                offset, offset8 = -BIAS * scale, -BIAS * scale8
            # Of x tile j: cs[4 j], cs[4 j + 1]: weight row g against x rows 8 j + 2 t, 8 j + 2 t + 1
            # (cs[4 j + 2], cs[4 j + 3]: row g + 8); ss[4 j], ss[4 j + 1]: the sums of those x rows over
            # the group.
            new_ys = ()
            for j in tl.static_range(X_TILES):
                s0, s1 = ss[4 * j][:, None], ss[4 * j + 1][:, None]
                new_ys = new_ys + (ys[4 * j] + cs[4 * j] * scale + s0 * offset,
                                   ys[4 * j + 1] + cs[4 * j + 1] * scale + s1 * offset,
                                   ys[4 * j + 2] + cs[4 * j + 2] * scale8 + s0 * offset8,
                                   ys[4 * j + 3] + cs[4 * j + 3] * scale8 + s1 * offset8)
            ys = new_ys
        w_a, w_a8, w_b, w_b8 = next_a, next_a8, next_b, next_b8
        scales = next_scales
        w_tile += 32
    _mma_store(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps, SPLIT, X_TILES)


@triton.jit
def _e4m3_pairs_to_f16x2(w):
    """An int32 word of four e4m3 values as two f16x2 registers, (bytes 0, 1) and (2, 3):
    the hardware conversion, exact (sm_89 on)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _bf16x2_to_f16x2(pair):
    """A bf16 pair as an fp16 pair, saturated to fp16's range (bf16's 8-bit mantissa fits
    fp16's 11 bits: exact down to fp16's smallest normal, 6e-5)."""
    low = tl.clamp((pair << 16).to(tl.float32, bitcast=True), -65504.0, 65504.0)
    high = tl.clamp((pair & -65536).to(tl.float32, bitcast=True), -65504.0, 65504.0)
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [high, low],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fp8_mma_kernel(
    x_ptr, w_ptr, scale_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    X_BF16: tl.constexpr, SPLIT: tl.constexpr, ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr,
    X_TILES: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    """Up to 8 X_TILES rows of x against e4m3 weights on tensor cores, as _int4_mma_kernel
    lays them out: each thread converts its own words into its A fragment (a word is four
    e4m3 values, two f16x2 registers by the hardware conversion), x's bf16 pairs become fp16
    pairs for the B fragment (fp16 MMAs, fp32 accumulators), and the MMA's k order is a
    permutation of K within 64-k segments (thread t's words 4 t .. 4 t + 3, one an MMA). A
    tile is 128 k, within one scale group (or one scale a row)."""
    if LAUNCH_NEXT:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    g, t, w_row, w_row8 = _mma_weight_rows(ROW_TILES, NUM_WARPS)
    first, last = _split_tiles(num_tiles, tiles_per_split)
    # Thread (g, t): words 16 h + 4 t .. + 3 of weight rows g and g + 8 in half h of a tile,
    # and x rows 8 j + g's pairs 32 h + 8 t .. + 7 (the same 16 k).
    w_g, w_g8, row_mask, row_mask8 = _mma_weight_pointers(w_ptr, w_row, t, stride_wn, N)
    x_tiles = _mma_x_pairs(x_ptr, g, 8 * t, stride_xm, M, X_TILES)
    zero = tl.zeros((32 * NUM_WARPS, ROW_TILES), dtype=tl.float32)

    ys = _repeat(zero, 4 * X_TILES)
    w_tile = first * 32
    w_a, w_a8, w_b, w_b8 = _mma_weight_tile(w_g, w_g8, row_mask, row_mask8, w_tile)
    for tile in range(first, last):
        # The next tile in flight while this one is multiplied; the last loads itself again.
        next_a, next_a8, next_b, next_b8 = _mma_weight_tile(w_g, w_g8, row_mask, row_mask8,
                                                             w_tile + tl.where(tile + 1 < last, 32, 0))
        cs = _repeat(zero, 4 * X_TILES)
        for h in tl.static_range(2):
            words = _unstack4(w_a if h == 0 else w_b)
            words8 = _unstack4(w_a8 if h == 0 else w_b8)
            x_words = ()  # x tile j's eight pairs: 8 j .. 8 j + 7
            for j in tl.static_range(X_TILES):
                x_pairs, x_mask = x_tiles[j]
                x_words = (x_words + _unstack4(tl.load(x_pairs + tile * 64 + h * 32, mask=x_mask, other=0))
                           + _unstack4(tl.load(x_pairs + tile * 64 + h * 32 + 4, mask=x_mask, other=0)))
            for word in tl.static_range(4):
                a0, a2 = _e4m3_pairs_to_f16x2(words[word])
                a1, a3 = _e4m3_pairs_to_f16x2(words8[word])
                new_cs = ()
                for j in tl.static_range(X_TILES):
                    pair0 = x_words[8 * j + 2 * word]  # x[4 w], x[4 w + 1] for the word's bytes 0, 1
                    pair1 = x_words[8 * j + 2 * word + 1]
                    if X_BF16:
                        pair0 = _bf16x2_to_f16x2(pair0)
                        pair1 = _bf16x2_to_f16x2(pair1)
                    new_cs = new_cs + _mma_m16n8k16(a0, a1, a2, a3, pair0[:, None], pair1[:, None], cs[4 * j],
                                                    cs[4 * j + 1], cs[4 * j + 2], cs[4 * j + 3], True)
                cs = new_cs
        group = tile * 128 // group_size
        scale = tl.load(scale_ptr + w_row * stride_sn + group, mask=row_mask, other=0.0)
        scale8 = tl.load(scale_ptr + w_row8 * stride_sn + group, mask=row_mask8, other=0.0)
        # Of x tile j: cs[4 j], cs[4 j + 1]: weight row g against x rows 8 j + 2 t, 8 j + 2 t + 1;
        # cs[4 j + 2], cs[4 j + 3]: row g + 8.
        new_ys = ()
        for j in tl.static_range(X_TILES):
            new_ys = new_ys + (ys[4 * j] + cs[4 * j] * scale, ys[4 * j + 1] + cs[4 * j + 1] * scale,
                               ys[4 * j + 2] + cs[4 * j + 2] * scale8, ys[4 * j + 3] + cs[4 * j + 3] * scale8)
        ys = new_ys
        w_a, w_a8, w_b, w_b8 = next_a, next_a8, next_b, next_b8
        w_tile += 32
    _mma_store(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps, SPLIT, X_TILES)


@triton.jit
def _e4m3(w, i: tl.constexpr):
    """Byte i of int32 words (k = 4 j + i) as the e4m3 value it holds, in fp32: exact,
    subnormals included (the hardware conversion, through fp16 on sm_90)."""
    return ((w >> (8 * i)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    X_BF16: tl.constexpr, GROUPED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """e4m3 weights as int32 words of 4 values, multiplied on the CUDA cores against up to
    BLOCK_M rows of x (the int4 "fma" kernel's layout). Per-channel scales apply once at the
    end, to products summed over all tiles (one reduction across threads per program);
    group scales once per tile (a tile lies within one group). With PDL the first tile's
    words load before the wait for the previous kernel (dependent_launch)."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    rows, cols, row_mask, col_mask, first, last = _program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 4
    words = tl.arange(0, WORDS)
    w_ptrs = w_ptr + cols[None, :, None].to(tl.int64) * stride_wn + (first * WORDS + words[None, None, :])
    w_mask = col_mask[None, :, None]
    x_ptrs = x_ptr + rows[:, None, None] * stride_xm + (first * BLOCK_K + 4 * words[None, None, :])
    x_mask = row_mask[:, None, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_x = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
    w = tl.load(w_ptrs, mask=w_mask, other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    for tile in range(first, last):
        # The next tile's words are in flight while this one is multiplied.
        w_next = tl.load(w_ptrs + WORDS, mask=w_mask & (tile + 1 < last), other=0)
        if GROUPED:
            w_x = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
        for pair in tl.static_range(2):
            x_even, x_odd = _load_x_pair(x_ptrs, pair, x_mask, X_BF16)
            w_x += _e4m3(w, 2 * pair) * x_even
            w_x += _e4m3(w, 2 * pair + 1) * x_odd
        if GROUPED:
            group = tile // tiles_per_group
            scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
            acc += tl.sum(w_x, axis=2) * scale[None, :]
        w = w_next
        w_ptrs += WORDS
        x_ptrs += BLOCK_K
    if not GROUPED:
        acc = tl.sum(w_x, axis=2) * tl.load(scale_ptr + cols * stride_sn, mask=col_mask, other=0.0)[None, :]
    _store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT, TRANSPOSED=False)


@triton.jit
def _unpack_e4m3_words(w, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """[N, BLOCK_K / 4] int32 words to [N, BLOCK_K] values of `dtype` in k order: byte
    i = 2 a + b of word j is k = 4 j + i (each join adds the next of a, b as a new minor
    dimension). e4m3 values are exact in bf16 and fp16."""
    lo = tl.join((w & 255).to(tl.uint8), ((w >> 16) & 255).to(tl.uint8))
    hi = tl.join(((w >> 8) & 255).to(tl.uint8), ((w >> 24) & 255).to(tl.uint8))
    return tl.join(lo, hi).reshape(w.shape[0], BLOCK_K).to(tl.float8e4nv, bitcast=True).to(dtype)


@triton.jit
def _fp8_dot_kernel(
    x_ptr, w_ptr, scale_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The e4m3 words upcast to x's dtype and multiplied on tensor cores, transposed as in
    _int4_dot_kernel (W x^T: on sm_90 a wgmma of BLOCK_N weight rows against BLOCK_M >= 16
    padded rows of x)."""
    rows, cols, row_mask, col_mask, first, last = _program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 4
    w_ptrs, w_mask, x_ptrs, x_mask = _dot_tile_pointers(x_ptr, w_ptr, rows, cols, row_mask, col_mask, first,
                                                        stride_xm, stride_wn, WORDS, BLOCK_K)
    act = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w = tl.load(w_ptrs, mask=w_mask, other=0)
    for tile in range(first, last):
        # The next tile's words are in flight while this one is multiplied.
        w_next = tl.load(w_ptrs + WORDS, mask=w_mask & (tile + 1 < last), other=0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if GROUPED:
            group = tile // tiles_per_group
            scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0)
            acc += tl.dot(_unpack_e4m3_words(w, act, BLOCK_K), x) * scale[:, None]
        else:
            acc = tl.dot(_unpack_e4m3_words(w, act, BLOCK_K), x, acc)
        w = w_next
        w_ptrs += WORDS
        x_ptrs += BLOCK_K
    if not GROUPED:
        acc *= tl.load(scale_ptr + cols * stride_sn, mask=col_mask, other=0.0)[:, None]
    _store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT, TRANSPOSED=True)


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 2  # split K until about this many programs per SM
    split_k: int | None = None  # fixed split (tests); None: from `waves` on CUDA, else 1
    # 4-bit and fp8 weights: the int32-word kernel, "fma" (CUDA cores) or "dot" (tensor
    # cores, block_m >= 16), block_m rows per program; or "mma" (tensor cores through
    # mma.sync, all rows (up to MMA_MAX_ROWS) in one program, block_n = 16 x row tiles x
    # num_warps; K tiles of 256 for 4-bit weights, 128 for fp8).
    # None (and int8 weights): block_m 1 is the CUDA-core kernel, one row per program (reads
    # W once per row), else tl.dot tiles.
    words: str | None = None


# 4-bit weights, (most rows, config): the first entry that covers the row count. The fastest
# per step's linears of `kvserve bench quantized-linears --sweep --sweep-formats int4` on an
# H100 (llama3-8b, BENCHMARKS.md): 1 row 2.36 ms (tiles of two 128-wide groups; bf16 cuBLAS
# 5.17), 4 and 8 rows 3.02 and 3.14 (mma.sync; the tl.dot tiles took 4.52 and 4.59). On an
# H200, 16 and 32 rows on mma.sync with 2 and 4 tiles of x: 3.59 and 5.00 ms (the tl.dot tiles
# 4.47 and 8.02; bf16 3.77 and 3.79); at 64 rows the tl.dot tiles, 8.65 (bf16 4.04): above 16
# rows 4-bit weights cost time, they save memory.
INT4_MMA_CONFIG = LaunchConfig(8, 128, 256, num_warps=4, num_stages=1, waves=2, words="mma")
# Where the mma kernel does not apply (groups narrower than 128, K not whole 256-k tiles).
INT4_TILE_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (SMALL_ROWS, LaunchConfig(16, 64, 128, num_stages=1, waves=4, words="dot")),
    (64, LaunchConfig(64, 64, 128, num_stages=1, waves=2, words="dot")),
)
INT4_DECODE_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (1, LaunchConfig(1, 128, 256, num_stages=1, waves=2, words="fma")),
    (8, INT4_MMA_CONFIG),
    (16, LaunchConfig(16, 32, 256, num_warps=2, num_stages=1, waves=4, words="mma")),
    (32, LaunchConfig(32, 128, 256, num_warps=4, num_stages=1, waves=2, words="mma")),
    INT4_TILE_CONFIGS[-1],
)
# One row of x against at least this many weight rows (llama3-8b's fused gate/up, 28672): a
# wide linear, which one row runs on other kernels than the narrow ones. 4-bit weights take
# the mma config there: 28.6 against 32.6 us on the H100, where the narrower linears stayed
# faster on the CUDA cores (qkv 10.1 against 11.4, o 8.3 / 9.1, down 17.4 / 19.2).
WIDE_AT_ONE_ROW_OUT_FEATURES = 16384
# fp8 weights, the same form, from `--sweep --sweep-formats fp8-triton` on the H100: 4 and 8
# rows 3.41 and 3.49 ms per llama3-8b step's linears on mma.sync (the byte tl.dot tiles: 3.60,
# 3.58). On an H200, 16 rows on mma.sync with 2 tiles of x: 3.22 ms (the byte tiles 3.60, bf16
# 3.68); at 32 rows the byte tiles (4.90; mma.sync 5.16). One row, by linear (H100, two sweeps,
# BENCHMARKS.md): mma.sync for the narrow ones, the byte kernel for the wide gate/up below.
FP8_MMA_CONFIG = LaunchConfig(16, 128, 128, num_warps=4, num_stages=1, waves=2, words="mma")
FP8_DECODE_CONFIGS: tuple[tuple[int, LaunchConfig], ...] = (
    (1, LaunchConfig(8, 128, 128, num_warps=4, num_stages=1, waves=4, words="mma")),
    (SMALL_ROWS, FP8_MMA_CONFIG),
)
# One row where the mma kernel does not apply (groups narrower than 128, K not whole tiles).
FP8_ONE_ROW_WORDS_CONFIG = LaunchConfig(1, 64, 256, num_stages=1, waves=4, words="fma")
# One row of x against a wide fp8 weight (WIDE_AT_ONE_ROW_OUT_FEATURES): the
# byte CUDA-core kernel, no split of K (llama3-8b's gate/up: 42.4 against 47.4 us on mma.sync
# and 51.2 on the word kernel, 92% of its bytes floor).
FP8_WIDE_ONE_ROW_CONFIG = LaunchConfig(1, 32, 256)


def default_config(rows: int, four_bit: bool, fp8: bool, out_features: int = 0, mma: bool = True) -> LaunchConfig:
    """int8 picked from llama3-8b's linears on an H200 (BENCHMARKS.md): at one row tl.dot
    tiles beat the CUDA-core kernel (3.47 against 3.88 ms per step's linears); 4-bit and
    fp8 weights: INT4_DECODE_CONFIGS and FP8_DECODE_CONFIGS, and at one row the rules for
    wide linears above. mma=False: the configs for weights the mma kernels do not take."""
    if rows == 1 and out_features >= WIDE_AT_ONE_ROW_OUT_FEATURES:
        if four_bit and mma:
            return INT4_MMA_CONFIG
        if fp8:
            return FP8_WIDE_ONE_ROW_CONFIG
    table = INT4_DECODE_CONFIGS if four_bit else FP8_DECODE_CONFIGS if fp8 else ()
    if not mma:
        table = INT4_TILE_CONFIGS if four_bit else ((1, FP8_ONE_ROW_WORDS_CONFIG),) if fp8 else ()
    if table and rows <= table[-1][0]:
        return next(config for most_rows, config in table if rows <= most_rows)
    if rows <= SMALL_ROWS:
        return LaunchConfig(16, 64, 128)
    return LaunchConfig(64, 128, 64)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


# Most rows of x the mma.sync kernels take: 8 X_TILES, X_TILES a power of two up to 4 (at
# 64 rows, 8 tiles, the kernels spill and lose to tl.dot tiles: BENCHMARKS.md).
MMA_MAX_ROWS = 32

# One counter per output tile for the in-kernel split-K sum; each launch leaves them at 0.
# Shared by every launch on the device: launches must not overlap (one stream at a time).
_MAX_SPLIT_COUNTERS = 16384


@functools.lru_cache(maxsize=None)
def _split_counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(_MAX_SPLIT_COUNTERS, dtype=torch.int32, device=device)


def _block_k(config: LaunchConfig, in_features: int, group_size: int, grouped: bool, four_bit: bool) -> int | None:
    """The K tile: within one group when grouped (halved until it divides the group size),
    or two whole groups for the 4-bit CUDA-core kernel (longer runs of each weight row);
    at least 16 stored elements (tl.dot's minimum); None when no tile fits."""
    block_k = config.block_k
    if config.words == "mma":
        return block_k  # checked with the rest of its conditions by _mma_applies
    if (four_bit and config.words == "fma" and block_k == 2 * group_size and group_size % 32 == 0
            and in_features % block_k == 0):
        return block_k
    if grouped:
        while block_k > 16 and group_size % block_k:
            block_k //= 2
        if group_size % block_k:
            return None
    if block_k // (2 if four_bit else 1) < 16:
        return None
    return block_k


def _split_k(config: LaunchConfig, num_tiles: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split): config.split_k, else enough splits for about `waves`
    programs per SM on CUDA; every split gets at least one tile."""
    split = config.split_k or 1
    if config.split_k is None and device.type == "cuda":
        split = max(1, min(num_tiles, triton.cdiv(config.waves * _num_sms(device.index or 0), programs)))
    tiles_per_split = triton.cdiv(num_tiles, split)
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


def _mma_applies(rows: torch.Tensor, group_size: int, grouped: bool, block_k: int) -> bool:
    """The mma.sync kernels: CUDA (sm_80 on), up to MMA_MAX_ROWS rows of bf16/fp16 x that
    load as aligned pairs, K in whole tiles and groups of whole 128-wide halves (or one a row)."""
    in_features = rows.shape[1]
    return (rows.is_cuda and rows.shape[0] <= MMA_MAX_ROWS and rows.dtype in (torch.bfloat16, torch.float16)
            and rows.stride(0) % 2 == 0 and rows.data_ptr() % 4 == 0 and in_features % block_k == 0
            and (not grouped or group_size % 128 == 0)
            and _capability(rows.device.index or 0) >= (8, 0))


def _words_apply(qweight: torch.Tensor, in_features: int, block_k: int, four_bit: bool, fp8: bool) -> bool:
    """The word kernels take whole K tiles of rows that start on a word."""
    if not (four_bit or fp8) or in_features % block_k:
        return False
    return qweight.stride(-1) == 1 and qweight.stride(0) % 4 == 0 and qweight.data_ptr() % 4 == 0


def _words_matmul(
    rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_size: int, config: LaunchConfig, block_k: int,
) -> torch.Tensor:
    """rows [M, K] times the nibble pairs or e4m3 values read as int32 words, by
    config.words; split-K partials summed in the kernel."""
    m, k = rows.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    dot = config.words == "dot"
    block_m = max(16, config.block_m) if dot else config.block_m  # tl.dot's minimum
    num_tiles = k // block_k
    # An mma program takes all rows (up to MMA_MAX_ROWS).
    grid_n, grid_m = triton.cdiv(n, config.block_n), 1 if config.words == "mma" else triton.cdiv(m, block_m)
    split, tiles_per_split = _split_k(config, num_tiles, grid_n * grid_m, rows.device)
    if grid_n * grid_m > _MAX_SPLIT_COUNTERS:
        split, tiles_per_split = 1, num_tiles
    partial = torch.empty((split, m, n), dtype=torch.float32, device=rows.device) if split > 1 else out
    words = qweight.view(torch.int32)
    x_tiles = triton.next_power_of_2(triton.cdiv(m, 8))  # mma: 8 rows of x an MMA's B
    if config.words == "mma" and qweight.dtype == torch.float8_e4m3fn:
        _fp8_mma_kernel[(grid_n, 1, split)](
            rows, words, scale, partial, out, _split_counters(rows.device),
            m, n, num_tiles, tiles_per_split, group_size,
            rows.stride(0), words.stride(0), scale.stride(0), m * n, n,
            X_BF16=rows.dtype == torch.bfloat16, SPLIT=split > 1,
            ROW_TILES=config.block_n // (16 * config.num_warps), NUM_WARPS=config.num_warps, X_TILES=x_tiles,
            LAUNCH_NEXT=dependent_launch.enabled(rows.device), num_warps=config.num_warps, num_stages=1,
        )
        return out
    if config.words == "mma":
        fp16 = rows.dtype == torch.float16
        _int4_mma_kernel[(grid_n, 1, split)](
            rows, words, scale, offset if offset is not None else scale, partial, out, _split_counters(rows.device),
            m, n, num_tiles, tiles_per_split, group_size, 0x64006400 if fp16 else 0x43004300,
            rows.stride(0), words.stride(0), scale.stride(0), m * n, n,
            FP16=fp16, HAS_OFFSET=offset is not None, SPLIT=split > 1,
            ROW_TILES=config.block_n // (16 * config.num_warps), NUM_WARPS=config.num_warps, X_TILES=x_tiles,
            LAUNCH_NEXT=dependent_launch.enabled(rows.device), num_warps=config.num_warps, num_stages=1,
        )
        return out
    fp8 = qweight.dtype == torch.float8_e4m3fn
    flags, launch = {}, {}
    if not dot:
        # bf16 pairs load as one int32 where aligned.
        aligned = rows.data_ptr() % 4 == 0 and rows.stride(0) % 2 == 0
        flags["X_BF16"] = rows.dtype == torch.bfloat16 and aligned
        # The one-row kernels, whose launch latency matters most (dependent_launch).
        launch = dependent_launch.launch_options(rows.device)
        flags["PDL"] = bool(launch)
    if fp8:
        kernel = _fp8_dot_kernel if dot else _fp8_gemv_kernel
        pointers, flags["GROUPED"] = (scale,), scale.shape[1] > 1
    else:
        kernel = _int4_dot_kernel if dot else _int4_gemv_kernel
        pointers, flags["HAS_OFFSET"] = (scale, offset if offset is not None else scale), offset is not None
        if not dot:
            flags["TWO_GROUPS"] = block_k == 2 * group_size
    # 1.0f as a run-time value: ptxas then merges mask and OR into one LOP3.
    one_bits = () if fp8 else (0x3F800000,)
    kernel[(grid_n, grid_m, split)](
        rows, words, *pointers, partial, out, _split_counters(rows.device),
        m, n, num_tiles, tiles_per_split, max(1, group_size // block_k), *one_bits,
        rows.stride(0), words.stride(0), scale.stride(0), m * n, n,
        SPLIT=split > 1, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **flags, **launch,
    )
    return out


def weight_only_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_size: int, four_bit: bool = False, config: LaunchConfig | None = None,
) -> torch.Tensor | None:
    """x [..., K] (bf16/fp16; fp32 too under the interpreter) times the quantized weight.
    qweight [N, K] int8 / float8_e4m3fn, or uint8 [N, K / 2] nibble pairs (four_bit,
    contiguous); scale and offset fp32 [N, K / group_size]. None where the kernel does not
    apply (odd K for 4-bit, groups narrower than a tile): the caller dequantizes instead."""
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
    config = config or default_config(m, four_bit, fp8, n)
    if config.words == "mma" and not _mma_applies(rows, group_size, grouped, config.block_k):
        # No CUDA (the interpreter), groups narrower than 128, K not whole mma tiles.
        config = default_config(m, four_bit, fp8, n, mma=False)
    block_k = _block_k(config, in_features, group_size, grouped, four_bit)
    if block_k is None or (four_bit and in_features % block_k):
        return None
    if config.words and _words_apply(qweight, in_features, block_k, four_bit, fp8):
        return _words_matmul(rows, qweight, scale, offset, group_size, config, block_k).reshape(*x.shape[:-1], n)
    num_tiles = triton.cdiv(in_features, block_k)
    programs = triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m)
    split, tiles_per_split = _split_k(config, num_tiles, programs, x.device)
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
            LAUNCH_NEXT=dependent_launch.enabled(x.device), num_warps=config.num_warps, num_stages=config.num_stages,
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


@triton.jit
def _unpack_kernel(
    w_ptr, scale_ptr, offset_ptr, out_ptr, bytes_per_row, stride_wn, stride_sn, stride_on,
    GROUP_BYTES: tl.constexpr, BLOCK_GROUPS: tl.constexpr, FOUR_BIT: tl.constexpr, HAS_OFFSET: tl.constexpr,
):
    """BLOCK_GROUPS whole groups of one weight row as offset + q * scale in fp32, rounded
    once to the output dtype. FOUR_BIT: byte j of a row holds k = 2 j (low nibble) and
    2 j + 1 (high), unsigned; else one signed int8 a byte. Loads and stores are contiguous
    runs of the row; one scale (and offset) a group."""
    PER_BYTE: tl.constexpr = 2 if FOUR_BIT else 1
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    byte = groups[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :]
    w = tl.load(w_ptr + row * stride_wn + byte, mask=byte < bytes_per_row, other=0)
    group_mask = groups < tl.cdiv(bytes_per_row, GROUP_BYTES)
    scale = tl.load(scale_ptr + row * stride_sn + groups, mask=group_mask, other=0.0)[:, None]
    offset = 0.0
    if HAS_OFFSET:
        offset = tl.load(offset_ptr + row * stride_sn + groups, mask=group_mask, other=0.0)[:, None]
    if FOUR_BIT:
        low = offset + (w & 15).to(tl.float32) * scale
        high = offset + (w >> 4).to(tl.float32) * scale
        values = tl.join(low, high).reshape(BLOCK_GROUPS, 2 * GROUP_BYTES)  # k = 2 j, 2 j + 1 in order
    else:
        values = offset + w.to(tl.float32) * scale
    cols = groups[:, None] * (PER_BYTE * GROUP_BYTES) + tl.arange(0, PER_BYTE * GROUP_BYTES)[None, :]
    tl.store(out_ptr + row * stride_on + cols, values.to(out_ptr.dtype.element_ty), mask=cols < PER_BYTE * bytes_per_row)


def unpack_weight(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
                  dtype: torch.dtype, four_bit: bool) -> torch.Tensor | None:
    """The weight [N, K] in `dtype`, from nibble pairs qweight [N, K / 2] (uint8, four_bit)
    or int8 qweight [N, K], and fp32 scale (and offset) [N, K / group_size], in one pass
    (read the stored bytes, write the dtype's): what a dense matmul of many rows runs on.
    None unless a group's bytes are a power of two from 1 to 512 (one tile row)."""
    n, bytes_per_row = qweight.shape
    group_bytes = group_size // 2 if four_bit else group_size
    if ((four_bit and group_size % 2) or group_bytes < 1 or group_bytes & (group_bytes - 1) or group_bytes > 512
            or qweight.stride(-1) != 1):
        return None
    out = torch.empty((n, bytes_per_row * (2 if four_bit else 1)), dtype=dtype, device=qweight.device)
    block_groups = max(1, 512 // group_bytes)  # 512 bytes of a row per program
    _unpack_kernel[(n, triton.cdiv(triton.cdiv(bytes_per_row, group_bytes), block_groups))](
        qweight, scale, offset if offset is not None else scale, out, bytes_per_row, qweight.stride(0),
        scale.stride(0), out.stride(0),
        GROUP_BYTES=group_bytes, BLOCK_GROUPS=block_groups, FOUR_BIT=four_bit, HAS_OFFSET=offset is not None,
    )
    return out
