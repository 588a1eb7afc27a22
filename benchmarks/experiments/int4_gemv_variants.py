import triton
import triton.language as tl
from kvserve.quantization.triton_kernels import (  # noqa: F401
    _group_scale_offset, _load_x_words, _nibble, _program_block, _store_block, _widen_x_pair)


@triton.jit
def _int4_gemv_v2(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_wn, stride_sn, stride_ps,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 8
    QUADS: tl.constexpr = WORDS // 4
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    rows, cols, row_mask, col_mask, first, last = _program_block(1, N, num_tiles, tiles_per_split, 1, BLOCK_N)
    quads = tl.arange(0, QUADS)
    lanes = tl.arange(0, 4)
    word = quads[None, :, None] * 4 + lanes[None, None, :]
    w_offsets = cols[:, None, None] * stride_wn + word
    w_mask = col_mask[:, None, None]
    w_tile = w_ptr + first * WORDS
    x_words = x_ptr.to(tl.pointer_type(tl.int32)) + first * (BLOCK_K // 2) + 4 * word
    if TWO_GROUPS:
        half = (quads >= QUADS // 2).to(tl.int32)[None, :]
    else:
        half = tl.zeros((1, QUADS), dtype=tl.int32)
    s_ptrs = scale_ptr + cols[:, None] * stride_sn + half
    o_ptrs = offset_ptr + cols[:, None] * stride_sn + half
    s_mask = col_mask[:, None]

    acc = tl.zeros((BLOCK_N, QUADS), dtype=tl.float32)
    w = tl.load(w_tile + w_offsets, mask=w_mask, other=0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(x_words + 0)
    x1 = tl.load(x_words + 1)
    x2 = tl.load(x_words + 2)
    x3 = tl.load(x_words + 3)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        n0 = tl.load(x_words + BLOCK_K // 2 + 0, mask=more, other=0)
        n1 = tl.load(x_words + BLOCK_K // 2 + 1, mask=more, other=0)
        n2 = tl.load(x_words + BLOCK_K // 2 + 2, mask=more, other=0)
        n3 = tl.load(x_words + BLOCK_K // 2 + 3, mask=more, other=0)
        group = tile * TILE_GROUPS // tiles_per_group
        scale = 128.0 * tl.load(s_ptrs + group, mask=s_mask, other=0.0)
        if HAS_OFFSET:
            offset = tl.load(o_ptrs + group, mask=s_mask, other=0.0) - scale
        else:
            offset = -scale
        f_x = tl.zeros((BLOCK_N, QUADS, 4), dtype=tl.float32)
        x_sum = tl.zeros((1, QUADS, 4), dtype=tl.float32)
        for pair in tl.static_range(4):
            xp = (x0, x1, x2, x3)[pair]
            x_even = (xp << 16).to(tl.float32, bitcast=True)
            x_odd = (xp & -65536).to(tl.float32, bitcast=True)
            f_x += _nibble(w, 2 * pair, one_bits) * x_even
            f_x += _nibble(w, 2 * pair + 1, one_bits) * x_odd
            x_sum += x_even + x_odd
        acc += tl.sum(f_x, axis=2) * scale + tl.sum(x_sum, axis=2) * offset
        w = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
        w_tile += WORDS
        x_words += BLOCK_K // 2
    y = tl.sum(acc, axis=1)[None, :]
    _store_block(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, 0, stride_ps,
                 SPLIT, TRANSPOSED=False)


@triton.jit
def _int4_gemv_v2b(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_wn, stride_sn, stride_ps,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 8
    QUADS: tl.constexpr = WORDS // 4
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    rows, cols, row_mask, col_mask, first, last = _program_block(1, N, num_tiles, tiles_per_split, 1, BLOCK_N)
    quads = tl.arange(0, QUADS)
    lanes = tl.arange(0, 4)
    word = quads[None, :, None] * 4 + lanes[None, None, :]
    w_offsets = cols[:, None, None] * stride_wn + word
    w_mask = col_mask[:, None, None]
    w_tile = w_ptr + first * WORDS
    x_words = x_ptr.to(tl.pointer_type(tl.int32)) + first * (BLOCK_K // 2) + 4 * word
    if TWO_GROUPS:
        half = (quads >= QUADS // 2).to(tl.int32)[None, :, None]
    else:
        half = tl.zeros((1, QUADS, 1), dtype=tl.int32)
    s_ptrs = scale_ptr + cols[:, None, None] * stride_sn + half
    o_ptrs = offset_ptr + cols[:, None, None] * stride_sn + half
    s_mask = col_mask[:, None, None]

    acc = tl.zeros((BLOCK_N, QUADS, 1), dtype=tl.float32)
    w = tl.load(w_tile + w_offsets, mask=w_mask, other=0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(x_words + 0)
    x1 = tl.load(x_words + 1)
    x2 = tl.load(x_words + 2)
    x3 = tl.load(x_words + 3)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        n0 = tl.load(x_words + BLOCK_K // 2 + 0, mask=more, other=0)
        n1 = tl.load(x_words + BLOCK_K // 2 + 1, mask=more, other=0)
        n2 = tl.load(x_words + BLOCK_K // 2 + 2, mask=more, other=0)
        n3 = tl.load(x_words + BLOCK_K // 2 + 3, mask=more, other=0)
        group = tile * TILE_GROUPS // tiles_per_group
        scale = 128.0 * tl.load(s_ptrs + group, mask=s_mask, other=0.0)
        if HAS_OFFSET:
            offset = tl.load(o_ptrs + group, mask=s_mask, other=0.0) - scale
        else:
            offset = -scale
        f_x = tl.zeros((BLOCK_N, QUADS, 4), dtype=tl.float32)
        x_sum = tl.zeros((1, QUADS, 4), dtype=tl.float32)
        for pair in tl.static_range(4):
            xp = (x0, x1, x2, x3)[pair]
            x_even = (xp << 16).to(tl.float32, bitcast=True)
            x_odd = (xp & -65536).to(tl.float32, bitcast=True)
            f_x += _nibble(w, 2 * pair, one_bits) * x_even
            f_x += _nibble(w, 2 * pair + 1, one_bits) * x_odd
            x_sum += x_even + x_odd
        acc += tl.sum(f_x, axis=2, keep_dims=True) * scale + tl.sum(x_sum, axis=2, keep_dims=True) * offset
        w = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
        w_tile += WORDS
        x_words += BLOCK_K // 2
    y = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    _store_block(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, 0, stride_ps,
                 SPLIT, TRANSPOSED=False)


@triton.jit
def _int4_gemv_v3(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_wn, stride_sn, stride_ps,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 8
    QUADS: tl.constexpr = WORDS // 4
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    rows, cols, row_mask, col_mask, first, last = _program_block(1, N, num_tiles, tiles_per_split, 1, BLOCK_N)
    words = tl.arange(0, WORDS)
    w_offsets = cols[None, :, None] * stride_wn + words[None, None, :]
    w_tile = w_ptr + first * WORDS
    w_mask = col_mask[None, :, None]
    x_tile = x_ptr.to(tl.pointer_type(tl.int32)) + first * (BLOCK_K // 2) + 4 * words[None, None, :]
    quads = tl.arange(0, QUADS)
    if TWO_GROUPS:
        half = (quads >= QUADS // 2).to(tl.int32)[None, None, :]
    else:
        half = tl.zeros((1, 1, QUADS), dtype=tl.int32)
    s_ptrs = scale_ptr + cols[None, :, None] * stride_sn + half
    o_ptrs = offset_ptr + cols[None, :, None] * stride_sn + half
    s_mask = col_mask[None, :, None]

    acc = tl.zeros((1, BLOCK_N, QUADS), dtype=tl.float32)
    w = tl.load(w_tile + w_offsets, mask=w_mask, other=0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(x_tile + 0)
    x1 = tl.load(x_tile + 1)
    x2 = tl.load(x_tile + 2)
    x3 = tl.load(x_tile + 3)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        n0 = tl.load(x_tile + BLOCK_K // 2 + 0, mask=more, other=0)
        n1 = tl.load(x_tile + BLOCK_K // 2 + 1, mask=more, other=0)
        n2 = tl.load(x_tile + BLOCK_K // 2 + 2, mask=more, other=0)
        n3 = tl.load(x_tile + BLOCK_K // 2 + 3, mask=more, other=0)
        group = tile * TILE_GROUPS // tiles_per_group
        scale = 128.0 * tl.load(s_ptrs + group, mask=s_mask, other=0.0)
        if HAS_OFFSET:
            offset = tl.load(o_ptrs + group, mask=s_mask, other=0.0) - scale
        else:
            offset = -scale
        f_x = tl.zeros((1, BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((1, 1, WORDS), dtype=tl.float32)
        for pair in tl.static_range(4):
            xp = (x0, x1, x2, x3)[pair]
            x_even = (xp << 16).to(tl.float32, bitcast=True)
            x_odd = (xp & -65536).to(tl.float32, bitcast=True)
            f_x += _nibble(w, 2 * pair, one_bits) * x_even
            f_x += _nibble(w, 2 * pair + 1, one_bits) * x_odd
            x_sum += x_even + x_odd
        f_q = tl.sum(f_x.reshape(1, BLOCK_N, QUADS, 4), axis=3)
        x_q = tl.sum(x_sum.reshape(1, 1, QUADS, 4), axis=3)
        acc += f_q * scale + x_q * offset
        w = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
        w_tile += WORDS
        x_tile += BLOCK_K // 2
    y = tl.sum(acc, axis=2)
    _store_block(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, 0, stride_ps,
                 SPLIT, TRANSPOSED=False)


@triton.jit
def _int4_gemv_v4(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_wn, stride_sn, stride_ps,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    WORDS: tl.constexpr = BLOCK_K // 8
    QUADS: tl.constexpr = WORDS // 4
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    rows, cols, row_mask, col_mask, first, last = _program_block(1, N, num_tiles, tiles_per_split, 1, BLOCK_N)
    words = tl.arange(0, WORDS)
    w_offsets = cols[None, :, None] * stride_wn + words[None, None, :]
    w_tile = w_ptr + first * WORDS
    w_mask = col_mask[None, :, None]
    x_tile = x_ptr.to(tl.pointer_type(tl.int32)) + first * (BLOCK_K // 2) + 4 * words[None, None, :]
    quads = tl.arange(0, QUADS)
    if TWO_GROUPS:
        half = (quads >= QUADS // 2).to(tl.int32)[None, None, :]
    else:
        half = tl.zeros((1, 1, QUADS), dtype=tl.int32)
    s_ptrs = scale_ptr + cols[None, :, None] * stride_sn + half
    o_ptrs = offset_ptr + cols[None, :, None] * stride_sn + half
    s_mask = col_mask[None, :, None]

    acc = tl.zeros((1, BLOCK_N, QUADS), dtype=tl.float32)
    w = tl.load(w_tile + w_offsets, mask=w_mask, other=0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(x_tile + 0)
    x1 = tl.load(x_tile + 1)
    x2 = tl.load(x_tile + 2)
    x3 = tl.load(x_tile + 3)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        n0 = tl.load(x_tile + BLOCK_K // 2 + 0, mask=more, other=0)
        n1 = tl.load(x_tile + BLOCK_K // 2 + 1, mask=more, other=0)
        n2 = tl.load(x_tile + BLOCK_K // 2 + 2, mask=more, other=0)
        n3 = tl.load(x_tile + BLOCK_K // 2 + 3, mask=more, other=0)
        group = tile * TILE_GROUPS // tiles_per_group
        scale = 128.0 * tl.load(s_ptrs + group, mask=s_mask, other=0.0)
        if HAS_OFFSET:
            offset = tl.load(o_ptrs + group, mask=s_mask, other=0.0) - scale
        else:
            offset = -scale
        # nibbles 3, 4 in place; w << 8: 1, 2; w >> 8: 5, 6; w << 12: 0; w >> 12: 7. At bits
        # 12-15 a nibble is 1 + q / 2048 (its x scaled by 16), at 16-19 1 + q / 128.
        xa = (x0 << 16).to(tl.float32, bitcast=True)
        xb = (x0 & -65536).to(tl.float32, bitcast=True)
        xc = (x1 << 16).to(tl.float32, bitcast=True)
        xd = (x1 & -65536).to(tl.float32, bitcast=True)
        xe = (x2 << 16).to(tl.float32, bitcast=True)
        xf = (x2 & -65536).to(tl.float32, bitcast=True)
        xg = (x3 << 16).to(tl.float32, bitcast=True)
        xh = (x3 & -65536).to(tl.float32, bitcast=True)
        x_plain = xa + xb + xc + xd + xe + xf + xg + xh
        xa = xa * 16.0
        xb = xb * 16.0
        xd = xd * 16.0
        xf = xf * 16.0
        x_scaled = xa + xb + xc + xd + xe + xf + xg + xh
        u = w << 8
        d = w >> 8
        m12 = 0xF000
        m16 = 0xF0000
        f_x = ((w & m12) | one_bits).to(tl.float32, bitcast=True) * xd
        f_x += ((w & m16) | one_bits).to(tl.float32, bitcast=True) * xe
        f_x += ((u & m12) | one_bits).to(tl.float32, bitcast=True) * xb
        f_x += ((u & m16) | one_bits).to(tl.float32, bitcast=True) * xc
        f_x += ((d & m12) | one_bits).to(tl.float32, bitcast=True) * xf
        f_x += ((d & m16) | one_bits).to(tl.float32, bitcast=True) * xg
        f_x += (((w << 12) & m12) | one_bits).to(tl.float32, bitcast=True) * xa
        f_x += (((w >> 12) & m16) | one_bits).to(tl.float32, bitcast=True) * xh
        f_q = tl.sum(f_x.reshape(1, BLOCK_N, QUADS, 4), axis=3)
        xs_q = tl.sum(x_scaled.reshape(1, 1, QUADS, 4), axis=3)
        x_q = tl.sum(x_plain.reshape(1, 1, QUADS, 4), axis=3)
        acc += (f_q - xs_q) * scale + x_q * (offset + scale)
        w = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
        w_tile += WORDS
        x_tile += BLOCK_K // 2
    y = tl.sum(acc, axis=2)
    _store_block(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, 0, stride_ps,
                 SPLIT, TRANSPOSED=False)


@triton.jit(do_not_specialize=["one"])
def _int4_gemv_v5(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    N, num_tiles, tiles_per_split, tiles_per_group, one_bits,
    stride_wn, stride_sn, stride_ps, one,
    HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO_GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    """A warp's 32 lanes read one weight row's 32 words of a tile (128 contiguous bytes), each
    thread BLOCK_N / num_warps rows of one word: x (8 values a thread), the row scales and
    the weights all share one layout, so nothing moves between threads until the end."""
    WORDS: tl.constexpr = BLOCK_K // 8
    TILE_GROUPS: tl.constexpr = 2 if TWO_GROUPS else 1
    rows, cols, row_mask, col_mask, first, last = _program_block(1, N, num_tiles, tiles_per_split, 1, BLOCK_N)
    # `one` is 1 at run time: the compiler cannot see the words as contiguous, so every
    # load below gets the same one-word-a-lane layout.
    words = tl.arange(0, WORDS) * one
    w_offsets = cols[None, :, None] * stride_wn + words[None, None, :]
    w_tile = w_ptr + first * WORDS
    w_mask = col_mask[None, :, None]
    x_tile = x_ptr.to(tl.pointer_type(tl.int32)) + first * (BLOCK_K // 2) + 4 * words[None, None, :]
    if TWO_GROUPS:
        half = words[None, None, :] // (WORDS // 2)
    else:
        half = words[None, None, :] * 0
    s_ptrs = scale_ptr + cols[None, :, None] * stride_sn + half
    o_ptrs = offset_ptr + cols[None, :, None] * stride_sn + half
    s_mask = col_mask[None, :, None]

    acc = tl.zeros((1, BLOCK_N, WORDS), dtype=tl.float32)
    w = tl.load(w_tile + w_offsets, mask=w_mask, other=0, eviction_policy="evict_first")
    group = first * TILE_GROUPS // tiles_per_group
    scale = 128.0 * tl.load(s_ptrs + group, mask=s_mask, other=0.0)
    if HAS_OFFSET:
        offset = tl.load(o_ptrs + group, mask=s_mask, other=0.0) - scale
    else:
        offset = -scale
    if PDL:
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(x_tile + 0)
    x1 = tl.load(x_tile + 1)
    x2 = tl.load(x_tile + 2)
    x3 = tl.load(x_tile + 3)
    for tile in range(first, last):
        more = tile + 1 < last
        w_next = tl.load(w_tile + WORDS + w_offsets, mask=w_mask & more, other=0, eviction_policy="evict_first")
        n0 = tl.load(x_tile + BLOCK_K // 2 + 0, mask=more, other=0)
        n1 = tl.load(x_tile + BLOCK_K // 2 + 1, mask=more, other=0)
        n2 = tl.load(x_tile + BLOCK_K // 2 + 2, mask=more, other=0)
        n3 = tl.load(x_tile + BLOCK_K // 2 + 3, mask=more, other=0)
        group = (tile + 1) * TILE_GROUPS // tiles_per_group
        scale_next = 128.0 * tl.load(s_ptrs + group, mask=s_mask & more, other=0.0)
        if HAS_OFFSET:
            offset_next = tl.load(o_ptrs + group, mask=s_mask & more, other=0.0) - scale_next
        else:
            offset_next = -scale_next
        xa = (x0 << 16).to(tl.float32, bitcast=True)
        xb = (x0 & -65536).to(tl.float32, bitcast=True)
        xc = (x1 << 16).to(tl.float32, bitcast=True)
        xd = (x1 & -65536).to(tl.float32, bitcast=True)
        xe = (x2 << 16).to(tl.float32, bitcast=True)
        xf = (x2 & -65536).to(tl.float32, bitcast=True)
        xg = (x3 << 16).to(tl.float32, bitcast=True)
        xh = (x3 & -65536).to(tl.float32, bitcast=True)
        x_plain = xa + xb + xc + xd + xe + xf + xg + xh
        xa = xa * 16.0
        xb = xb * 16.0
        xd = xd * 16.0
        xf = xf * 16.0
        x_scaled = xa + xb + xc + xd + xe + xf + xg + xh
        u = w << 8
        d = w >> 8
        m12 = 0xF000
        m16 = 0xF0000
        f_x = ((w & m12) | one_bits).to(tl.float32, bitcast=True) * xd
        f_x += ((w & m16) | one_bits).to(tl.float32, bitcast=True) * xe
        f_x += ((u & m12) | one_bits).to(tl.float32, bitcast=True) * xb
        f_x += ((u & m16) | one_bits).to(tl.float32, bitcast=True) * xc
        f_x += ((d & m12) | one_bits).to(tl.float32, bitcast=True) * xf
        f_x += ((d & m16) | one_bits).to(tl.float32, bitcast=True) * xg
        f_x += (((w << 12) & m12) | one_bits).to(tl.float32, bitcast=True) * xa
        f_x += (((w >> 12) & m16) | one_bits).to(tl.float32, bitcast=True) * xh
        acc += (f_x - x_scaled) * scale + x_plain * (offset + scale)
        w, scale, offset = w_next, scale_next, offset_next
        x0, x1, x2, x3 = n0, n1, n2, n3
        w_tile += WORDS
        x_tile += BLOCK_K // 2
    y = tl.sum(acc, axis=2)
    _store_block(y, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, 0, stride_ps,
                 SPLIT, TRANSPOSED=False)


@triton.jit
def _int4_gemv_v6(
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
        xa, xb = _widen_x_pair(x01, X_BF16)
        xc, xd = _widen_x_pair(x23, X_BF16)
        xe, xf = _widen_x_pair(x45, X_BF16)
        xg, xh = _widen_x_pair(x67, X_BF16)
        x_sum = xa + xb + xc + xd + xe + xf + xg + xh
        xa = xa * 16.0
        xb = xb * 16.0
        xd = xd * 16.0
        xf = xf * 16.0
        f_x = -(xa + xb + xc + xd + xe + xf + xg + xh)
        u = w << 8
        d = w >> 8
        f_x += ((w & 0xF000) | one_bits).to(tl.float32, bitcast=True) * xd
        f_x += ((w & 0xF0000) | one_bits).to(tl.float32, bitcast=True) * xe
        f_x += ((u & 0xF000) | one_bits).to(tl.float32, bitcast=True) * xb
        f_x += ((u & 0xF0000) | one_bits).to(tl.float32, bitcast=True) * xc
        f_x += ((d & 0xF000) | one_bits).to(tl.float32, bitcast=True) * xf
        f_x += ((d & 0xF0000) | one_bits).to(tl.float32, bitcast=True) * xg
        f_x += (((w << 12) & 0xF000) | one_bits).to(tl.float32, bitcast=True) * xa
        f_x += (((w >> 12) & 0xF0000) | one_bits).to(tl.float32, bitcast=True) * xh
        if TWO_GROUPS:
            acc += (f_x * tl.where(second_half, scale2[None, :, None], scale[None, :, None])
                    + x_sum * tl.where(second_half, offset2[None, :, None] + scale2[None, :, None],
                                       offset[None, :, None] + scale[None, :, None]))
        else:
            acc += f_x * scale[None, :, None] + x_sum * (offset + scale)[None, :, None]
        w, scale, offset, scale2, offset2 = w_next, scale_next, offset_next, scale2_next, offset2_next
        x01, x23, x45, x67 = x_next
        w_tile += WORDS
        x_tile += BLOCK_K
    _store_block(tl.sum(acc, axis=2), rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr,
                 stride_om, stride_ps, SPLIT, TRANSPOSED=False)
