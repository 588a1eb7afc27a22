"""The mma.sync kernels for 4-bit and fp8 weights at 1-32 rows of x: each thread builds its
own tensor-core A fragment from the words it loaded (inline PTX: mma.sync m16n8k16, PRMT,
the e4m3 conversion), so nothing passes through shared memory."""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.ops.pending_norm_tiles import norm_row_scale
from kvserve.ops.quant.weight_only.tiles import split_tiles, store_output
from kvserve.ops.split_k import arrives_last, rearm, summed_splits


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
def _mma_x_rows(t, X_TILES: tl.constexpr):
    """Thread (g, t)'s x rows in the accumulators of m16n8k16: 8 j + 2 t and 8 j + 2 t + 1 of
    each x tile j, as a tuple of [threads] tensors."""
    x_rows = ()
    for j in tl.static_range(X_TILES):
        x_rows = x_rows + (8 * j + 2 * t, 8 * j + 2 * t + 1)
    return x_rows


@triton.jit
def _mma_row_scales(pending_ptr, t, M, pending_partials, num_cols, norm_eps, PARTIALS: tl.constexpr,
                    X_TILES: tl.constexpr):
    """norm_row_scale of thread (g, t)'s x rows (_mma_x_rows), as [threads, 1] tensors: the
    8 X_TILES rows' scales computed once for the program (a few values a thread), then each
    thread picks its own."""
    all_rows = tl.arange(0, 8 * X_TILES)
    row_scales = norm_row_scale(pending_ptr, all_rows, all_rows < M, pending_partials, num_cols, norm_eps,
                                PARTIALS)
    scales = ()
    x_rows = _mma_x_rows(t, X_TILES)
    for i in tl.static_range(2 * X_TILES):
        picked = tl.where(x_rows[i][:, None] == all_rows[None, :], row_scales[None, :], 0.0)
        scales = scales + (tl.sum(picked, axis=1)[:, None],)
    return scales


@triton.jit
def _mma_scale_rows(ys, row_scales, X_TILES: tl.constexpr):
    """ys (_mma_store's layout) with each x row's output multiplied by its row scale."""
    scaled = ()
    for j in tl.static_range(X_TILES):
        scaled = scaled + (ys[4 * j] * row_scales[2 * j], ys[4 * j + 1] * row_scales[2 * j + 1],
                           ys[4 * j + 2] * row_scales[2 * j], ys[4 * j + 3] * row_scales[2 * j + 1])
    return scaled


@triton.jit
def _mma_blocks(ys, t, w_row, M, N, stride_om, X_TILES: tl.constexpr):
    """Thread (g, t)'s outputs as one block a x tile (values, offsets into out, masks), each
    [threads, ROW_TILES, 4]: of x tile j, ys[4 j .. 4 j + 3] are weight rows g and g + 8
    against x rows 8 j + 2 t and 8 j + 2 t + 1, the accumulators' layout of m16n8k16."""
    w_row8 = w_row + 8
    accs, offss, masks = (), (), ()
    for j in tl.static_range(X_TILES):
        x_row = (8 * j + 2 * t)[:, None]
        accs = accs + (_stack4(ys[4 * j], ys[4 * j + 1], ys[4 * j + 2], ys[4 * j + 3]),)
        offss = offss + (_stack4(x_row * stride_om + w_row, (x_row + 1) * stride_om + w_row,
                                 x_row * stride_om + w_row8, (x_row + 1) * stride_om + w_row8),)
        masks = masks + (_stack4((x_row < M) & (w_row < N), (x_row + 1 < M) & (w_row < N),
                                 (x_row < M) & (w_row8 < N), (x_row + 1 < M) & (w_row8 < N)),)
    return accs, offss, masks


@triton.jit
def _mma_store(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
               SPLIT: tl.constexpr, X_TILES: tl.constexpr):
    """Write thread (g, t)'s outputs (_mma_blocks), or with split K their partials, summed by
    the last split to finish."""
    accs, offss, masks = _mma_blocks(ys, t, w_row, M, N, stride_om, X_TILES)
    store_output(accs, offss, masks, partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT)


@triton.jit
def _mma_add_norm(accs, offss, masks, t, w_row, N, M, out_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr,
                  X_TILES: tl.constexpr):
    """pending_norm_tiles.add_norm_store for _mma_blocks' blocks of final values: h =
    residual + y in the run dtype (the residual stream updated in place, out's strides), out =
    h * the norm's weight, and each x row's sum of h^2 over this program's weight rows at
    sum_squares[row, program]. A row's squares are spread over the threads holding it: each
    thread sums its own, then the x rows' totals are picked out as _mma_row_scales does."""
    dtype = out_ptr.dtype.element_ty
    w_row8 = w_row + 8
    weight = tl.load(norm_weight_ptr + w_row, mask=w_row < N, other=0.0).to(tl.float32)
    weight8 = tl.load(norm_weight_ptr + w_row8, mask=w_row8 < N, other=0.0).to(tl.float32)
    weights = _stack4(weight, weight, weight8, weight8)
    zeros = tl.zeros_like(w_row)
    odd_row = _stack4(zeros, zeros + 1, zeros, zeros + 1) == 1  # a block's values of x row 8 j + 2 t + 1
    all_rows = tl.arange(0, 8 * X_TILES)
    row_sums = tl.zeros((8 * X_TILES,), dtype=tl.float32)
    for j in tl.static_range(X_TILES):
        # Rounded as `residual + linear(x)` would be: y to the run dtype, then the sum.
        residual = tl.load(residual_ptr + offss[j], mask=masks[j], other=0.0).to(tl.float32)
        h = (accs[j].to(dtype).to(tl.float32) + residual).to(dtype)
        tl.store(residual_ptr + offss[j], h, mask=masks[j])
        h = tl.where(masks[j], h.to(tl.float32), 0.0)
        tl.store(out_ptr + offss[j], (weights * h).to(dtype), mask=masks[j])
        # This thread's squares of x rows 8 j + 2 t and 8 j + 2 t + 1 (stacked as the block is).
        even = tl.sum(tl.sum(tl.where(odd_row, 0.0, h * h), axis=2), axis=1)
        odd = tl.sum(tl.sum(tl.where(odd_row, h * h, 0.0), axis=2), axis=1)
        first_row = 8 * j + 2 * t
        row_sums += tl.sum(tl.where(first_row[:, None] == all_rows[None, :], even[:, None], 0.0)
                           + tl.where(first_row[:, None] + 1 == all_rows[None, :], odd[:, None], 0.0), axis=0)
    tl.store(sum_squares_ptr + all_rows * tl.num_programs(0) + tl.program_id(0), row_sums, mask=all_rows < M)


@triton.jit
def _mma_store_add_norm(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                        residual_ptr, norm_weight_ptr, sum_squares_ptr, SPLIT: tl.constexpr, X_TILES: tl.constexpr):
    """_mma_store for a linear followed by a residual add and an RMSNorm (PendingNorm):
    _mma_add_norm on the final values (with split K, by the last split to finish)."""
    accs, offss, masks = _mma_blocks(ys, t, w_row, M, N, stride_om, X_TILES)
    if SPLIT:
        if arrives_last(accs, partial_ptr, count_ptr, offss, masks, stride_ps):
            totals = ()
            for j in tl.static_range(X_TILES):
                totals = totals + (summed_splits(partial_ptr, offss[j], masks[j], stride_ps),)
            _mma_add_norm(totals, offss, masks, t, w_row, N, M, out_ptr, residual_ptr, norm_weight_ptr,
                          sum_squares_ptr, X_TILES)
            rearm(count_ptr)
    else:
        _mma_add_norm(accs, offss, masks, t, w_row, N, M, out_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr,
                      X_TILES)


@triton.jit
def _int4_mma_tile_scales(scale_ptr, offset_ptr, w_row, w_row8, row_mask, row_mask8, stride_sn, tile, group_size,
                          HAS_OFFSET: tl.constexpr):
    """For each half of 256-k tile `tile`: the scales of weight rows g and g + 8 and (with
    HAS_OFFSET) their offsets, as stored. Loaded a tile ahead, like the words: they come from
    DRAM (a row's scales lie a row of groups apart), and nothing may wait on them early."""
    out = ()
    for h in tl.static_range(2):
        group = (tile * 256 + h * 128) // group_size
        out = out + (tl.load(scale_ptr + w_row * stride_sn + group, mask=row_mask, other=0.0).to(tl.float32),
                     tl.load(scale_ptr + w_row8 * stride_sn + group, mask=row_mask8, other=0.0).to(tl.float32))
        if HAS_OFFSET:
            out = out + (tl.load(offset_ptr + w_row * stride_sn + group, mask=row_mask, other=0.0).to(tl.float32),
                         tl.load(offset_ptr + w_row8 * stride_sn + group, mask=row_mask8, other=0.0).to(tl.float32))
    return out


@triton.jit
def int4_mma_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr, pending_ptr,
    M, N, num_tiles, tiles_per_split, group_size, magic,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om, pending_partials, norm_eps,
    FP16: tl.constexpr, HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr,
    ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr, X_TILES: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
    ROW_SCALE: tl.constexpr, PARTIALS: tl.constexpr,
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
    layout conversions; an x tile's are a tuple. Not launched as a programmatic dependent:
    waiting as one (after the first tile) made W2 int4's step 0.06 ms longer on an H100, and
    0.2 ms longer with fp16 scales (BENCHMARKS.md, "Tried, did not pay"); it lets the next
    kernel launch early.
    ROW_SCALE: x's RMSNorm was left pending by the previous linear (int4_gemv_kernel's
    ADD_NORM); the output rows are scaled by its rsqrt(mean(h^2) + eps)."""
    if LAUNCH_NEXT:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    THREADS: tl.constexpr = 32 * NUM_WARPS
    ONES: tl.constexpr = 0x3C003C00 if FP16 else 0x3F803F80
    BIAS: tl.constexpr = 1024.0 if FP16 else 128.0
    g, t, w_row, w_row8 = _mma_weight_rows(ROW_TILES, NUM_WARPS)
    first, last = split_tiles(num_tiles, tiles_per_split, EVEN_SPLITS)
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
    if ROW_SCALE:  # read after the loop: read before it, gate/up ran 7 us slower in the step
        ys = _mma_scale_rows(ys, _mma_row_scales(pending_ptr, t, M, pending_partials, num_tiles * 256, norm_eps,
                                                 PARTIALS, X_TILES), X_TILES)
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
def fp8_mma_kernel(
    x_ptr, w_ptr, scale_ptr, partial_ptr, out_ptr, count_ptr,
    pending_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr,
    M, N, num_tiles, tiles_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om, pending_partials, norm_eps,
    X_BF16: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr, ROW_TILES: tl.constexpr,
    NUM_WARPS: tl.constexpr, X_TILES: tl.constexpr, PDL: tl.constexpr, ROW_SCALE: tl.constexpr,
    PARTIALS: tl.constexpr, ADD_NORM: tl.constexpr,
):
    """Up to 8 X_TILES rows of x against e4m3 weights on tensor cores, as int4_mma_kernel
    lays them out: each thread converts its own words into its A fragment (a word is four
    e4m3 values, two f16x2 registers by the hardware conversion), x's bf16 pairs become fp16
    pairs for the B fragment (fp16 MMAs, fp32 accumulators), and the MMA's k order is a
    permutation of K within 64-k segments (thread t's words 4 t .. 4 t + 3, one an MMA). A
    tile is 128 k, within one scale group (or one scale a row). With PDL the first tile loads
    before the wait for the previous kernel (kvserve.ops.pdl).
    Fused RMSNorms (PendingNorm), as in int4_gemv_kernel: ROW_SCALE scales the output rows by
    the factor of the norm the previous linear left pending; ADD_NORM adds the output to the
    residual stream and leaves the next norm pending (_mma_store_add_norm)."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    g, t, w_row, w_row8 = _mma_weight_rows(ROW_TILES, NUM_WARPS)
    first, last = split_tiles(num_tiles, tiles_per_split, EVEN_SPLITS)
    # Thread (g, t): words 16 h + 4 t .. + 3 of weight rows g and g + 8 in half h of a tile,
    # and x rows 8 j + g's pairs 32 h + 8 t .. + 7 (the same 16 k).
    w_g, w_g8, row_mask, row_mask8 = _mma_weight_pointers(w_ptr, w_row, t, stride_wn, N)
    x_tiles = _mma_x_pairs(x_ptr, g, 8 * t, stride_xm, M, X_TILES)
    zero = tl.zeros((32 * NUM_WARPS, ROW_TILES), dtype=tl.float32)

    ys = _repeat(zero, 4 * X_TILES)
    w_tile = first * 32
    w_a, w_a8, w_b, w_b8 = _mma_weight_tile(w_g, w_g8, row_mask, row_mask8, w_tile)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
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
    if ROW_SCALE:
        ys = _mma_scale_rows(ys, _mma_row_scales(pending_ptr, t, M, pending_partials, num_tiles * 128, norm_eps,
                                                 PARTIALS, X_TILES), X_TILES)
    if ADD_NORM:
        _mma_store_add_norm(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps, residual_ptr,
                            norm_weight_ptr, sum_squares_ptr, SPLIT, X_TILES)
    else:
        _mma_store(ys, t, w_row, M, N, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps, SPLIT, X_TILES)
