"""The int32-word kernels for 4-bit and fp8 weights: 8 nibbles or 4 e4m3 values a load,
multiplied on the CUDA cores ("fma", few rows) or on tensor cores through tl.dot ("dot")."""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.ops.pending_norm_tiles import norm_row_scale
from kvserve.ops.quant.weight_only.tiles import (
    dot_tile_pointers,
    group_scale_offset,
    load_x_pair,
    load_x_words,
    nibble,
    program_block,
    store_block,
    store_block_add_norm,
    widen_x_pair,
)


@triton.jit
def _paired(low, high):
    """Two fp32 [N] blocks as one int64 block, low's bits in the low word."""
    low_bits = low.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return low_bits | (high.to(tl.int32, bitcast=True).to(tl.int64) << 32)


@triton.jit
def _unpaired(pair):
    """_paired's two fp32 blocks back."""
    return pair.to(tl.int32).to(tl.float32, bitcast=True), (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def int4_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    pending_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om, pending_partials, norm_eps,
    X_BF16: tl.constexpr, HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr,
    PDL: tl.constexpr, ROW_SCALE: tl.constexpr, PARTIALS: tl.constexpr, ADD_NORM: tl.constexpr,
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
    tile's words and scales load before the wait for the previous kernel (kvserve.ops.pdl).

    Fused RMSNorms (PendingNorm): ROW_SCALE takes x whose norm the previous linear left
    pending (x = h * weight, the row sums of h^2 at pending_ptr) and scales the output rows
    by rsqrt(mean(h^2) + eps); ADD_NORM adds this linear's output to the residual stream and
    leaves the next norm pending in turn (store_block_add_norm)."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    rows, cols, row_mask, col_mask, first, last = program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N, EVEN_SPLITS)
    WORDS: tl.constexpr = BLOCK_K // 8
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    words = tl.arange(0, WORDS)
    # [rows, cols, words] throughout: the weight load fixes the layout (4 words a thread,
    # every row of x in each thread). Only the group scales and offsets move between threads
    # inside the loop: loaded one column a thread, they go through shared memory into the
    # tile's layout, two barriers a conversion. Two groups' scales (and offsets) convert as
    # one int64, 4 barriers a tile instead of 8: W2 int4 0.05 ms a step faster, as fast as
    # with the scales hoisted out of the loop.
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
    scale, offset = group_scale_offset(scale_ptrs, offset_ptrs, group, col_mask, HAS_OFFSET)
    scale2, offset2 = group_scale_offset(scale_ptrs, offset_ptrs, group + 1, col_mask & TWO_GROUPS, HAS_OFFSET)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x01, x23, x45, x67 = load_x_words(x_tile, x_mask, X_BF16)
    if ROW_SCALE:
        row_scale = norm_row_scale(pending_ptr, rows, row_mask, pending_partials, num_tiles * BLOCK_K, norm_eps,
                                   PARTIALS)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        x_next = load_x_words(x_tile + BLOCK_K, x_mask & more, X_BF16)
        group = (tile + 1) * TILE_GROUPS // tiles_per_group
        scale_next, offset_next = group_scale_offset(scale_ptrs, offset_ptrs, group, col_mask & more, HAS_OFFSET)
        scale2_next, offset2_next = group_scale_offset(scale_ptrs, offset_ptrs, group + 1,
                                                        col_mask & more & TWO_GROUPS, HAS_OFFSET)
        f_x = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M, 1, WORDS), dtype=tl.float32)
        for pair in tl.static_range(4):
            x_even, x_odd = widen_x_pair((x01, x23, x45, x67)[pair], X_BF16)
            f_x += nibble(w, 2 * pair, one_bits) * x_even
            f_x += nibble(w, 2 * pair + 1, one_bits) * x_odd
            x_sum += x_even + x_odd
        if TWO_GROUPS:
            scale_lo, scale_hi = _unpaired(_paired(scale, scale2)[None, :, None])
            offset_lo, offset_hi = _unpaired(_paired(offset, offset2)[None, :, None])
            acc += (f_x * tl.where(second_half, scale_hi, scale_lo)
                    + x_sum * tl.where(second_half, offset_hi, offset_lo))
        else:
            acc += f_x * scale[None, :, None] + x_sum * offset[None, :, None]
        w, scale, offset, scale2, offset2 = w_next, scale_next, offset_next, scale2_next, offset2_next
        x01, x23, x45, x67 = x_next
        w_tile += WORDS
        x_tile += BLOCK_K
    y = tl.sum(acc, axis=2)
    if ROW_SCALE:
        y *= row_scale[:, None]
    if ADD_NORM:
        store_block_add_norm(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om,
                             stride_ps, residual_ptr, norm_weight_ptr, sum_squares_ptr, SPLIT)
    else:
        store_block(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                    SPLIT, TRANSPOSED=False)


@triton.jit
def _unpack_words(w, one_bits, BLOCK_K: tl.constexpr):
    """[N, BLOCK_K / 8] int32 words to [N, BLOCK_K] fp32 1 + q / 128 in k order: nibble
    i = 4 a + 2 b + c of word j is k = 8 j + i, and each join adds the next of a, b, c as a
    new minor dimension."""
    h0 = tl.join(tl.join(nibble(w, 0, one_bits), nibble(w, 4, one_bits)),
                 tl.join(nibble(w, 2, one_bits), nibble(w, 6, one_bits)))
    h1 = tl.join(tl.join(nibble(w, 1, one_bits), nibble(w, 5, one_bits)),
                 tl.join(nibble(w, 3, one_bits), nibble(w, 7, one_bits)))
    return tl.join(h0, h1).reshape(w.shape[0], BLOCK_K)


@triton.jit
def int4_dot_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The same words and 1 + q / 128 values on tensor cores, computed transposed (W x^T:
    the weight tile is the dot's M side, so on sm_90 it is a wgmma of BLOCK_N rows with
    BLOCK_M >= 16 padded rows of x as its N side). The values 1 + q / 128 are exact in
    bf16 and fp16."""
    rows, cols, row_mask, col_mask, first, last = program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N, EVEN_SPLITS)
    WORDS: tl.constexpr = BLOCK_K // 8
    w_ptrs, w_mask, x_ptrs, x_mask = dot_tile_pointers(x_ptr, w_ptr, rows, cols, row_mask, col_mask, first,
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
        scale = 128.0 * tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0).to(tl.float32)
        offset = -scale
        if HAS_OFFSET:
            offset += tl.load(offset_ptr + cols * stride_sn + group, mask=col_mask, other=0.0).to(tl.float32)
        acc += f_x * scale[:, None] + tl.sum(x.to(tl.float32), axis=0)[None, :] * offset[:, None]
        w = w_next
        w_ptrs += WORDS
        x_ptrs += BLOCK_K
    store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT, TRANSPOSED=True)


@triton.jit
def _e4m3(w, i: tl.constexpr):
    """Byte i of int32 words (k = 4 j + i) as the e4m3 value it holds, in fp32: exact,
    subnormals included (the hardware conversion, through fp16 on sm_90)."""
    return ((w >> (8 * i)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    X_BF16: tl.constexpr, GROUPED: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """e4m3 weights as int32 words of 4 values, multiplied on the CUDA cores against up to
    BLOCK_M rows of x (the int4 "fma" kernel's layout). Per-channel scales apply once at the
    end, to products summed over all tiles (one reduction across threads per program);
    group scales once per tile (a tile lies within one group). With PDL the first tile's
    words load before the wait for the previous kernel (kvserve.ops.pdl)."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    rows, cols, row_mask, col_mask, first, last = program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N, EVEN_SPLITS)
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
            x_even, x_odd = load_x_pair(x_ptrs, pair, x_mask, X_BF16)
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
    store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
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
def fp8_dot_kernel(
    x_ptr, w_ptr, scale_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, tiles_per_group,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The e4m3 words upcast to x's dtype and multiplied on tensor cores, transposed as in
    int4_dot_kernel (W x^T: on sm_90 a wgmma of BLOCK_N weight rows against BLOCK_M >= 16
    padded rows of x)."""
    rows, cols, row_mask, col_mask, first, last = program_block(M, N, num_tiles, tiles_per_split,
                                                                 BLOCK_M, BLOCK_N, EVEN_SPLITS)
    WORDS: tl.constexpr = BLOCK_K // 4
    w_ptrs, w_mask, x_ptrs, x_mask = dot_tile_pointers(x_ptr, w_ptr, rows, cols, row_mask, col_mask, first,
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
    store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                 SPLIT, TRANSPOSED=True)
