import triton
import triton.language as tl

from kvserve.quantization.triton_kernels import _store_summed_splits


@triton.jit
def _mma_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FP16: tl.constexpr):
    """One warp-wide mma.sync m16n8k16 (fp32 accumulators): each thread passes its own
    fragment registers (the PTX ISA's layout for A row-major, B column-major)."""
    if FP16:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _prmt(a, b, selector: tl.constexpr):
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {selector};", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _nibble_pairs(w, i: tl.constexpr, magic):
    """Nibbles i and i + 4 of each int32 word as a 16-bit float pair (MAGIC + q, MAGIC + q'):
    q in the low mantissa bits of 128 (bf16) or 1024 (fp16), exact."""
    return ((w >> (4 * i)) & 0x000F000F) | magic


@triton.jit
def _unstack4(t):
    """[T, 4] per-thread values as four [T] tensors, in order."""
    a, b = tl.split(t.reshape(t.shape[0], 2, 2))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _unstack4_3d(t):
    """[T, R, 4] per-thread values as four [T, R] tensors, in order."""
    a, b = tl.split(t.reshape(t.shape[0], t.shape[1], 2, 2))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _stack4(a, b, c, d):
    return tl.join(tl.join(a, b), tl.join(c, d)).reshape(a.shape[0], a.shape[1], 4)


@triton.jit
def _int4_mma_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, group_size, magic,
    stride_xm, stride_wn, stride_sn, stride_ps, stride_om,
    FP16: tl.constexpr, HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr, NUM_WARPS: tl.constexpr,
    ROW_TILES: tl.constexpr, PDL: tl.constexpr,
):
    """Up to 8 rows of x against ROW_TILES x 16 weight rows a warp, on tensor cores through
    mma.sync (m16n8k16): each thread unpacks its own A fragment from the stored words with one
    LOP3 a register (nibbles i and i + 4 of a word as 128 + q in bf16, exact), so the MMA's k
    order is a permutation of K, and x's B fragment follows it (two PRMTs). A tile is 256 k:
    two groups of 128, each thread one 16-byte load a weight row and group. The column sums of
    x (for the offsets) come from the same MMA with a ones fragment. Per-thread tensors are
    [ROW_TILES, threads]: element (r, i) is thread i's value for its r-th 16-row tile."""
    THREADS: tl.constexpr = 32 * NUM_WARPS
    ONES: tl.constexpr = 0x3C003C00 if FP16 else 0x3F803F80
    BIAS: tl.constexpr = 1024.0 if FP16 else 128.0
    tid = tl.arange(0, THREADS)[:, None]
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    r = tl.arange(0, ROW_TILES)[None, :]
    w_row = tl.program_id(0) * (16 * ROW_TILES * NUM_WARPS) + (tid // 32) * (16 * ROW_TILES) + 16 * r + g
    w_row8 = w_row + 8
    first = tl.program_id(2) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    quad = tl.arange(0, 4)[None, None, :]
    # Thread (g, t): words 16 h + 4 t .. + 3 of its weight rows in group-half h of a tile.
    w_g = w_ptr + w_row[:, :, None].to(tl.int64) * stride_wn + (4 * t)[:, :, None] + quad
    w_g8 = w_g + 8 * stride_wn
    w_mask = (w_row < N)[:, :, None]
    w_mask8 = (w_row8 < N)[:, :, None]
    # ... and x row g's bf16 pairs of those words (B's column g is x's row g).
    lane1 = tl.arange(0, THREADS) % 32
    x_rows = (x_ptr.to(tl.pointer_type(tl.int32)) + ((lane1 // 4) * (stride_xm // 2) + 16 * (lane1 % 4))[:, None]
              + tl.arange(0, 4)[None, :])
    x_mask = (lane1 // 4 < M)[:, None]
    s_g = scale_ptr + w_row * stride_sn
    s_g8 = s_g + 8 * stride_sn
    o_g = offset_ptr + w_row * stride_sn
    o_g8 = o_g + 8 * stride_sn
    s_mask = w_row < N
    s_mask8 = w_row8 < N
    ones = tl.full((THREADS,), ONES, dtype=tl.int32)
    zero1 = tl.zeros((THREADS,), dtype=tl.float32)
    zero = tl.zeros((THREADS, ROW_TILES), dtype=tl.float32)

    y00, y01, y80, y81 = zero, zero, zero, zero
    tile_w = first * 32
    a0 = tl.load(w_g + tile_w, mask=w_mask, other=0, eviction_policy="evict_first")
    a8 = tl.load(w_g8 + tile_w, mask=w_mask8, other=0, eviction_policy="evict_first")
    b0 = tl.load(w_g + tile_w + 16, mask=w_mask, other=0, eviction_policy="evict_first")
    b8 = tl.load(w_g8 + tile_w + 16, mask=w_mask8, other=0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    for tile in range(first, last):
        step = tl.where(tile + 1 < last, 32, 0)  # the last tile loads itself again: no masks
        next_a0 = tl.load(w_g + tile_w + step, mask=w_mask, other=0, eviction_policy="evict_first")
        next_a8 = tl.load(w_g8 + tile_w + step, mask=w_mask8, other=0, eviction_policy="evict_first")
        next_b0 = tl.load(w_g + tile_w + step + 16, mask=w_mask, other=0, eviction_policy="evict_first")
        next_b8 = tl.load(w_g8 + tile_w + step + 16, mask=w_mask8, other=0, eviction_policy="evict_first")
        for h in tl.static_range(2):
            words_g = _unstack4_3d(a0 if h == 0 else b0)
            words_g8 = _unstack4_3d(a8 if h == 0 else b8)
            c0, c1, c2, c3 = zero, zero, zero, zero
            x0, x1, x2, x3 = zero1, zero1, zero1, zero1
            for wi in tl.static_range(4):
                pairs = _unstack4(tl.load(x_rows + tile * 128 + h * 64 + 4 * wi, mask=x_mask, other=0))
                for half in tl.static_range(2):
                    lo = pairs[half]
                    hi = pairs[half + 2]
                    xb0 = _prmt(lo, hi, 0x5410)  # (x[8w + 2 half], x[8w + 2 half + 4])
                    xb1 = _prmt(lo, hi, 0x7632)  # (x[8w + 2 half + 1], x[8w + 2 half + 5])
                    c0, c1, c2, c3 = _mma_16816(
                        _nibble_pairs(words_g[wi], 2 * half, magic), _nibble_pairs(words_g8[wi], 2 * half, magic),
                        _nibble_pairs(words_g[wi], 2 * half + 1, magic), _nibble_pairs(words_g8[wi], 2 * half + 1, magic),
                        xb0[:, None], xb1[:, None], c0, c1, c2, c3, FP16)
                    x0, x1, x2, x3 = _mma_16816(ones, ones, ones, ones, xb0, xb1, x0, x1, x2, x3, FP16)
            group = (tile * 256 + h * 128) // group_size
            scale_g = tl.load(s_g + group, mask=s_mask, other=0.0)
            scale_g8 = tl.load(s_g8 + group, mask=s_mask8, other=0.0)
            if HAS_OFFSET:
                off_g = tl.load(o_g + group, mask=s_mask, other=0.0) - BIAS * scale_g
                off_g8 = tl.load(o_g8 + group, mask=s_mask8, other=0.0) - BIAS * scale_g8
            else:
                off_g = -BIAS * scale_g
                off_g8 = -BIAS * scale_g8
            # c0, c1: weight row g against x rows 2t, 2t + 1; c2, c3: row g + 8. x0, x1: the
            # column sums of x rows 2t, 2t + 1.
            y00 += c0 * scale_g + x0[:, None] * off_g
            y01 += c1 * scale_g + x1[:, None] * off_g
            y80 += c2 * scale_g8 + x0[:, None] * off_g8
            y81 += c3 * scale_g8 + x1[:, None] * off_g8
        a0, a8, b0, b8 = next_a0, next_a8, next_b0, next_b8
        tile_w += 32
    x_row0 = 2 * t
    offs = _stack4(x_row0 * stride_om + w_row, (x_row0 + 1) * stride_om + w_row,
                   x_row0 * stride_om + w_row8, (x_row0 + 1) * stride_om + w_row8)
    mask = _stack4((x_row0 < M) & s_mask, (x_row0 + 1 < M) & s_mask, (x_row0 < M) & s_mask8, (x_row0 + 1 < M) & s_mask8)
    acc = _stack4(y00, y01, y80, y81)
    if SPLIT:
        _store_summed_splits(acc, partial_ptr, out_ptr, count_ptr, offs, mask, stride_ps)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
