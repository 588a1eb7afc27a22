"""Paged attention over a flat varlen batch (prefill chunks and decodes mixed).

One program attends one tile of query rows to one KV head's context. A tile's rows are
(token, head) pairs of BLOCK_M // GROUP_PAD consecutive tokens times the GROUP query
heads sharing that KV head, so every K/V tile is read once for the whole head group and
the matrix units see at least 16 rows even for a single decode token. Tokens of a chunk
sit at the last positions of their sequence's context and attend causally through the
block table. With num_kv_splits > 1 (flash decoding) each program covers one slice of
the context and writes unnormalised partials that a second kernel merges.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve import envs
from kvserve.ops import device as device_info
from kvserve.ops import pdl
from kvserve.ops.attention.batch import PagedBatch
from kvserve.ops.elementwise import rope_factor, rotate_pair

LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Owner of a global query tile. Sequence i's tiles are numbered from
    query_start_loc[i] // BLOCK_Q + i: strictly increasing in i and leaving each sequence
    at least cdiv(q_len, BLOCK_Q) numbers, so a binary search finds the owner with no
    host-side tile table."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _float8_to_f16(v, FORMAT: tl.constexpr):
    """A float8 tile (FORMAT "e4m3" or "e5m2") as fp16, two values an instruction, exact.
    Declared impure so that Triton keeps the conversion where it is written, on V as loaded:
    V then reaches shared memory as fp16 and the dot reads it with ldmatrix.trans. With
    .to(), Triton converts after the shared-memory round trip, where the transposed operand
    is gathered a byte at a time (sm_90 SASS of a 128-key tile: 128 LDS.U8 a thread; the
    loop 1385 instructions, 866 with this)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        f"cvt.rn.f16x2.{FORMAT}x2 $0, lo; cvt.rn.f16x2.{FORMAT}x2 $1, hi; }}",
        "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, V_FLOAT8_ASM: tl.constexpr):
    """Online softmax over one key tile: k [D, N] and v [N, D], visible [M, N] the keys each
    query row sees. Returns the running max (log2 domain), denominator and sum, updated."""
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet (padding rows) keep -inf; subtract 0 to avoid NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FLOAT8_ASM != "":
        v = _float8_to_f16(v, V_FLOAT8_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_new_keys(q, q_pos, q_start, q_len, num_cached, kv_head, m_i, l_i, acc, qk_scale, key_ptr,
                     value_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, stride_kt,
                     stride_kh, stride_vt, stride_vh, stride_cs, stride_cache_slot, stride_cache_head, tree_bits,
                     HEAD_DIM: tl.constexpr, NEW_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     TREE: tl.constexpr):
    """A sequence's q_len new keys (positions num_cached on) as one more key tile, taken from
    the step's unrotated keys [T, KVH, D] and values: rotated here, stored at their cache slots
    (slot < 0: padding, not stored) and attended causally. Columns past q_len repeat its last
    token, so every load stays in bounds, and are masked."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    column = tl.arange(0, NEW_KEYS)
    tokens = (q_start + tl.minimum(column, q_len - 1)).to(tl.int64)
    key_cols = key_ptr + tokens[None, :] * stride_kt + kv_head * stride_kh
    rope = tokens[None, :] * stride_cs + (dims % HALF)[:, None]
    dtype = key_ptr.dtype.element_ty
    signed_sin = tl.where(dims < HALF, -1.0, 1.0)[:, None] * rope_factor(sin_ptr + rope, dtype)
    k = rotate_pair(tl.load(key_cols + dims[:, None]), tl.load(key_cols + (dims ^ HALF)[:, None]),
                    rope_factor(cos_ptr + rope, dtype), signed_sin, k_cache_ptr.dtype.element_ty)
    v = tl.load(value_ptr + tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :])
    slots = tl.load(slot_mapping_ptr + tokens)
    stored = (column < q_len) & (slots >= 0)
    cache = slots * stride_cache_slot + kv_head * stride_cache_head
    tl.store(k_cache_ptr + cache[None, :] + dims[:, None], k, mask=stored[None, :])
    tl.store(v_cache_ptr + cache[:, None] + dims[None, :], v, mask=stored[:, None])
    visible = ((num_cached + column)[None, :] <= q_pos[:, None]) & (column < q_len)[None, :]
    if TREE:
        visible &= _tree_visible(tree_bits, column)
    return _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION, "")


@triton.jit
def _tree_visible(tree_bits, step_column):
    """[M, N]: whether each row sees the key of the step's token at step_column (the key's
    index among its sequence's query tokens; < 0: a cached key, seen): bit step_column of
    the row's tree_bits. Columns from 64 on have no bit and stay causal."""
    shift = tl.minimum(tl.maximum(step_column, 0), 63).to(tl.int64)
    bit = (tree_bits[:, None] >> shift[None, :]) & 1
    return (bit != 0) | ((step_column < 0) | (step_column >= 64))[None, :]


# Integers that vary from step to step are not specialised (Triton would compile a variant
# for each of == 1, a multiple of 16 and neither, in the middle of serving); num_seqs == 1
# would also clash, as a constant, with the search's loop-carried int32.
@triton.jit(do_not_specialize=["num_seqs", "num_kv_splits", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] output, or [T, H, S, D] fp32 partial sums when split
    max_ptr,  # [T, H, S] fp32 running max (log2 domain), split only
    sum_ptr,  # [T, H, S] fp32 softmax denominators, split only
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    key_ptr,  # NEW_KV: the step's keys [T, KVH, D], not yet rotated, and values
    value_ptr,
    cos_ptr,  # NEW_KV: RoPE's cos and sin [T, D / 2] fp32 at each token's position
    sin_ptr,
    slot_mapping_ptr,  # NEW_KV: each token's cache slot (< 0: padding, not stored)
    tree_bits_ptr,  # TREE: [T] int64, bit j: the token sees its sequence's j-th query token
    num_seqs,
    num_heads,
    num_kv_splits,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,  # KV cache slots a block: k // BLOCK_SIZE is a shift
    SPLIT: tl.constexpr,  # num_kv_splits > 1: write partials for the merge kernel
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # bf16 queries over a float8 cache: both dots in fp16
    V_FLOAT8_ASM: tl.constexpr,  # "e4m3"/"e5m2": convert V on CUDA before its layout change
    PDL: tl.constexpr,
    # Under PDL, wait only after reading the sequence's metadata, which nothing in the step's
    # chain writes (host copies and torch kernels ahead of the first layer, which launch no
    # dependents, fill it). For narrow decode batches, whose few programs wait on a chain of
    # loads; wide ones lost ~1% of W1 to the extra registers.
    EARLY_METADATA: tl.constexpr,
    # Decode batches (one query token a sequence) on the short-context tile (fuses_new_kv): q
    # and k arrive unrotated, and this kernel applies RoPE to both and stores the new key and
    # value in the cache itself (the program whose split holds the last key), using them from
    # registers; two kernels a layer fewer (rotary, cache write) in the decode chain.
    NEW_KV: tl.constexpr,
    # Verify-width batches on the short-context tile (fuses_new_kv), each sequence's tokens in
    # one program's rows: the same, with the new keys as one more tile of NEW_KEYS columns
    # after the cached ones (_attend_new_keys), in split 0. 0: not this mode.
    NEW_KEYS: tl.constexpr,
    # Speculative token trees: each query row sees the step's tokens its tree_bits name (its
    # ancestors and itself) instead of all earlier ones; every cached key as before.
    TREE: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not EARLY_METADATA:
            tl.extra.cuda.gdc_wait()
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        if PDL and EARLY_METADATA:
            tl.extra.cuda.gdc_wait()  # no program ends before the kernel it follows
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    dims = tl.arange(0, HEAD_DIM)
    HALF: tl.constexpr = HEAD_DIM // 2
    if NEW_KV:
        # Also written ahead of the step's chain: the token's cos, sin and slot.
        new_token = q_start.to(tl.int64)
        halves = new_token * stride_cs + dims % HALF
        cos = rope_factor(cos_ptr + halves, q_ptr.dtype.element_ty)
        signed_sin = tl.where(dims < HALF, -1.0, 1.0) * rope_factor(sin_ptr + halves, q_ptr.dtype.element_ty)
        new_slot = tl.load(slot_mapping_ptr + new_token)
    if PDL and EARLY_METADATA:
        tl.extra.cuda.gdc_wait()

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # token within the chunk
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_pos = seq_len - q_len + q_idx  # context position of the row's token
    token = q_start + q_idx
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=row_valid[:, None], other=0.0)
    if NEW_KV:
        partner = tl.load(q_rows + (dims ^ HALF)[None, :], mask=row_valid[:, None], other=0.0)
        q = rotate_pair(q, partner, cos[None, :], signed_sin[None, :], q_ptr.dtype.element_ty)
    if NEW_KEYS > 0:
        # Each row at its own token's position; padding rows read their sequence's first.
        partner = tl.load(q_rows + (dims ^ HALF)[None, :], mask=row_valid[:, None], other=0.0)
        rope = tl.where(row_valid, token, q_start).to(tl.int64)[:, None] * stride_cs + (dims % HALF)[None, :]
        row_sin = tl.where(dims < HALF, -1.0, 1.0)[None, :] * rope_factor(sin_ptr + rope, q_ptr.dtype.element_ty)
        q = rotate_pair(q, partner, rope_factor(cos_ptr + rope, q_ptr.dtype.element_ty), row_sin,
                        q_ptr.dtype.element_ty)
    tree_bits = 0
    if TREE:
        tree_bits = tl.load(tree_bits_ptr + token, mask=row_valid, other=-1)
    if FP16_DOTS:
        # e4m3 and e5m2 convert to fp16 in one instruction for two values (to bf16 through
        # fp32); fp16 also holds q and the probabilities more precisely than bf16.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Keys up to the last valid token of this tile, this split's share of them. With
    # NEW_KEYS the loop reads only the cached keys; the step's own follow it from registers.
    if NEW_KEYS > 0:
        kv_len = seq_len - q_len
    else:
        kv_len = seq_len - q_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_kv_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    if NEW_KV:
        new_pos = seq_len - 1  # the new token's key
        owns_new = (new_pos // BLOCK_N >= tile_start) & (new_pos // BLOCK_N < tile_end)
        new_k_row = key_ptr + new_token * stride_kt + kv_head * stride_kh
        new_k = rotate_pair(tl.load(new_k_row + dims, mask=owns_new, other=0.0),
                            tl.load(new_k_row + (dims ^ HALF), mask=owns_new, other=0.0),
                            cos, signed_sin, k_cache_ptr.dtype.element_ty)
        new_v = tl.load(value_ptr + new_token * stride_vt + kv_head * stride_vh + dims, mask=owns_new, other=0.0)
        new_cache = new_slot * stride_cache_slot + kv_head * stride_cache_head + dims
        stores_new = owns_new & (new_slot >= 0)
        tl.store(k_cache_ptr + new_cache, new_k, mask=stores_new)
        tl.store(v_cache_ptr + new_cache, new_v, mask=stores_new)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_len
        if NEW_KV:
            is_new = k_pos == new_pos
            k_valid &= ~is_new  # not read back from the cache: it is in registers
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        # int64: a large cache holds more than 2**31 elements.
        slot = block * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot
        slot += kv_head * stride_cache_head
        k = tl.load(k_cache_ptr + slot[None, :] + dims[:, None], mask=k_valid[None, :], other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=k_valid[:, None], other=0.0)
        if NEW_KV:
            k = tl.where(is_new[None, :], new_k[:, None], k)
            v = tl.where(is_new[:, None], new_v[None, :], v)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < kv_len)[None, :]
        if TREE:
            visible &= _tree_visible(tree_bits, k_pos - (seq_len - q_len))
        m_i, l_i, acc = _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION, V_FLOAT8_ASM)
    if NEW_KEYS > 0:
        if split == 0:  # a split that always runs, so the merge's running max starts finite
            m_i, l_i, acc = _attend_new_keys(
                q, q_pos, q_start, q_len, kv_len, kv_head, m_i, l_i, acc, qk_scale, key_ptr, value_ptr, cos_ptr,
                sin_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_cs, stride_cache_slot, stride_cache_head, tree_bits, HEAD_DIM, NEW_KEYS, DOT_PRECISION,
                TREE)

    if not SPLIT:
        out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (token * num_heads + head) * num_kv_splits + split
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc * v_scale,
                 mask=row_valid[:, None])
        tl.store(max_ptr + part, m_i, mask=row_valid)
        tl.store(sum_ptr + part, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_kv_splits"])
def _merge_splits_kernel(
    out_ptr,
    partial_ptr,
    max_ptr,
    sum_ptr,
    num_heads,
    num_kv_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.chained(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    first_part = (token * num_heads + head) * num_kv_splits
    dims = tl.arange(0, HEAD_DIM)
    # Online merge; split 0 always holds key 0, so the running max is finite from it on
    # and empty splits (max -inf, sum 0) weigh nothing.
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for part in range(first_part, first_part + num_kv_splits):
        m = tl.load(max_ptr + part)
        m_new = tl.maximum(m_run, m)
        alpha = tl.exp2(m_run - m_new)
        weight = tl.exp2(m - m_new)
        l_run = l_run * alpha + tl.load(sum_ptr + part) * weight
        acc = acc * alpha + tl.load(partial_ptr + part * HEAD_DIM + dims) * weight
        m_run = m_new
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, (acc / l_run).to(out_ptr.dtype.element_ty))


class TileConfig(NamedTuple):
    block_m: int  # query rows (tokens x group heads) per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


# Decode tiles hold a single token's head group: 16 rows is the matrix units' minimum. 256 keys
# a tile over 8 warps: a quarter of the serial K/V round trips of 64 for short contexts (H100,
# llama3-8b heads, a step's 32 layers in one CUDA graph, 64 -> 256 keys: batch 1 at 192 keys
# 265 -> 217 us, at 1024 keys 722 -> 430, batch 8 at 192 keys 330 -> 281;
# benchmarks/gpu_decode_tile_sweep.py).
DECODE_TILE = TileConfig(block_m=16, block_n=256, num_warps=8, num_stages=2)
# fp32 models: 256 fp32 keys and values a tile would not fit in shared memory.
FP32_DECODE_TILE = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
# Batches of WIDE_BATCH sequences or more fill the GPU with (sequence, KV head) programs: 128
# keys over 4 warps then beat 256 over 8 (H100, llama3-8b heads, one layer at 1024 keys: bf16
# cache, batch 16 47.1 -> 42.0 us, 256 399 -> 379; e4m3 cache, batch 64 122 -> 85, batch 256
# 399 -> 304). Smaller batches keep the 256-key tile's fewer round trips.
WIDE_DECODE_TILE = TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=2)
WIDE_BATCH = 16
# Decode batches of at most SHORT_PROGRAMS (sequence, KV head) programs over at most
# SHORT_CONTEXT keys, with a 16- or 8-bit cache: 32-key tiles over 4 warps, the context split into
# up to MAX_SHORT_SPLITS slices of one or two tiles each (choose_decode_plan). On the H100, 32
# llama3-8b layers in one CUDA graph, us a step at batch 1, this plan against the 256-key
# tile with MIN_KEYS_PER_SPLIT's splits: 128 keys 121 / 175, 192 141 / 181, 256 159 / 188,
# 512 199 / 314, 1024 271 / 346; batch 2 149 / 183 at 128 keys, 313 / 373 at 1024 (the
# 256-key tile's few programs run their tiles one after another). W2 int4 (batch 1) TPOT: 2.54
# -> 2.52 ms at 128-256 keys, 2.75 -> 2.59 at 384-512, 2.91 -> 2.62 at 896-1024; with an
# e4m3 cache 2.60 -> 2.57 and 3.01 -> 2.66.
SHORT_DECODE_TILE = TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
SHORT_PROGRAMS = 16
# Verify batches (1 + k tokens a sequence) take the same plan, up to SHORT_VERIFY_CONTEXT keys
# and MAX_SHORT_VERIFY_SPLITS; on this tile a program holds the rows (tokens x head group,
# padded to powers of two) of its sequence's whole width, up to MAX_WHOLE_WIDTH_ROWS, so each
# K/V tile is read once for all of them (short_tile_rows).
MAX_WHOLE_WIDTH_ROWS = 64
# Past 1024 keys, int4 llama3-8b dummy, the engine's steps (verify_cost, 1 + 4 tokens),
# against the 256-key tile after the RoPE and cache-write kernels, ms: plain 1025 keys 2.461 /
# 2.528, 1537 2.473 / 2.540, 2049 2.552 / 2.570, 3073 2.638-2.648 / 2.605-2.614 (slower: decode
# steps stop at 2048); verify 1029 keys 3.070 / 3.318, 1541 3.157 / 3.488, 2053 3.227 / 3.380,
# 3077 3.382 / 3.544, 4005 3.524 / 3.628.
SHORT_CONTEXT = 2048
SHORT_VERIFY_CONTEXT = 4096
# Decode steps: 32 splits from 769 keys (32 layers in one graph, us a step at batch 1: 1024
# keys 264 against 294 at 16 splits, batch 2 328 / 354; 768 keys even). A verify program's tiles
# carry its whole width: fewer, longer splits (1025 keys 385 us at 16 splits, 418 at 32; batch
# 2, 2049 keys 588 / 805).
MAX_SHORT_SPLITS = 32
MAX_SHORT_VERIFY_SPLITS = 16
# Except one sequence's verify step (at most LONG_VERIFY_PROGRAMS programs) past
# LONG_VERIFY_CONTEXT keys, which takes MAX_SHORT_SPLITS: width 5 at batch 1, alone, 16 / 32
# splits 2053 keys 512 / 511 us, 2565 572 / 564, 3077 625 / 579, 4005 734 / 651; the engine's
# verify step (int4, k = 4) 3077 keys 3.381-3.382 -> 3.365-3.371 ms, 4005 3.499 -> 3.413.
LONG_VERIFY_CONTEXT = 2048
LONG_VERIFY_PROGRAMS = 8
# Decode batches of WIDE_SHORT_BATCH sequences or more over at most WIDE_SHORT_CONTEXT keys
# and a 16-bit cache: the 32-key tile unsplit (their programs fill the GPU several times),
# which also takes the step's RoPE and KV write (fuses_new_kv). H100, llama3-8b: the
# attention alone, 32 layers in one graph, against WIDE_DECODE_TILE: batch 64 at 192 keys
# 26.6 -> 22.9 us a layer, 384 keys 42.1 -> 41.0, and at 640 keys (batch 256) no faster; W2
# (128-384 keys) graph p50 at batch 64, two rounds: fp8 5.38 -> 5.28 ms, bf16 7.28-7.35 ->
# 7.18-7.20; at batch 16 (128 programs, under one wave) slower: 4.22 -> 4.36, 6.59 -> 6.67;
# with 256 keys as the limit batch 64 gained less.
WIDE_SHORT_BATCH = 64
WIDE_SHORT_CONTEXT = 384
PREFILL_TILE = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
MAX_KV_SPLITS = 64
KV_SPLIT_WAVES = 4
# Fewer keys than this per split and the merge costs more than the parallelism buys. H100,
# llama3-8b, a step's 32 layers in one CUDA graph, DECODE_TILE, us a step by splits: batch 1
# at 1025 keys 2 (at 512 keys a split) 471, 8 257; at 2048 keys 4 382, 8 310, 16 > 328; at
# 4096 8 473, 16 411, 32 439; batch 2 at 2048 4 462, 8 393 (benchmarks/gpu_decode_tile_sweep.py).
MIN_KEYS_PER_SPLIT = 256
# Speculative verify steps (1 + k tokens) are decode-like: few rows, the whole context.
MAX_SPLIT_QUERY_LEN = 17


# The tiles of narrow decode batches (one or two waves of programs at most): they read their
# metadata before the PDL wait.
NARROW_DECODE_TILES = (DECODE_TILE, SHORT_DECODE_TILE)


class NewKV(NamedTuple):
    """A decode or verify step's unrotated keys and values [T, KVH, D] and RoPE's cos and sin
    [T, D / 2] (fp32), for the attention kernel to rotate and store itself."""

    key: torch.Tensor
    value: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def batch_tile(metadata: PagedBatch, dtype: torch.dtype, tile: TileConfig | None) -> TileConfig:
    """The tile a batch runs: `tile` if given, else the default for its shape and dtype."""
    if tile is not None:
        return tile
    if metadata.max_query_len > 1:
        return PREFILL_TILE
    if dtype.itemsize > 2:
        return FP32_DECODE_TILE
    return WIDE_DECODE_TILE if metadata.num_seqs >= WIDE_BATCH else DECODE_TILE


def short_tile_rows(max_query_len: int, group_pad: int) -> int:
    """Query rows a program of SHORT_DECODE_TILE holds: a token's head group padded to the
    matrix units' 16, or a verify batch's whole width where it fits MAX_WHOLE_WIDTH_ROWS."""
    whole_width = group_pad * triton.next_power_of_2(max_query_len)
    return max(SHORT_DECODE_TILE.block_m, group_pad, min(whole_width, MAX_WHOLE_WIDTH_ROWS))


def _whole_width_fits(max_query_len: int, group_pad: int) -> bool:
    """Whether every sequence's tokens fit one short-tile program's rows."""
    return max_query_len * group_pad <= short_tile_rows(max_query_len, group_pad)


def fuses_new_kv(metadata: PagedBatch, tile: TileConfig | None, dtype: torch.dtype,
                 kv_cache_dtype: torch.dtype, group: int) -> bool:
    """Whether paged_attention takes this batch's RoPE and cache write (new_kv): a batch on
    the short-context tile over a cache of the query's dtype (a float8 cache's keys need a
    scale and a basis change first), of one query token a sequence or of verify widths whose
    every sequence fits one program's rows (short_tile_rows; `group` query heads a KV head).
    On the 256-key tile the new key and value held through the loop spill (sm_90: 172 -> 255
    registers and a stack); the 32-key tile takes them in 128 registers (80 without)."""
    if kv_cache_dtype != dtype or batch_tile(metadata, dtype, tile) != SHORT_DECODE_TILE:
        return False
    return _whole_width_fits(metadata.max_query_len, triton.next_power_of_2(group))


class DecodePlan(NamedTuple):
    """How paged_attention runs a batch: its KV splits, and its key tile (None: the default
    for the batch). A CUDA graph pins one."""

    num_kv_splits: int
    tile: TileConfig | None = None


def _short_plan_serves(kv_cache_dtype: torch.dtype) -> bool:
    """16- and 8-bit caches take the short-context plan (fp32 ones keep FP32_DECODE_TILE)."""
    return kv_cache_dtype.itemsize <= 2


def choose_decode_plan(metadata: PagedBatch, num_kv_heads: int, kv_cache_dtype: torch.dtype,
                       device: torch.device) -> DecodePlan:
    """SHORT_DECODE_TILE over a power of two of splits, one or two tiles each, for the narrow
    decode and verify batches of short contexts it serves faster (a 16- or 8-bit cache);
    otherwise the default tile over choose_num_kv_splits' splits."""
    tiles = triton.cdiv(metadata.max_seq_len, SHORT_DECODE_TILE.block_n)
    decode = metadata.max_query_len == 1
    if (metadata.max_query_len <= MAX_SPLIT_QUERY_LEN and metadata.num_seqs * num_kv_heads <= SHORT_PROGRAMS
            and _short_plan_serves(kv_cache_dtype) and 1 < tiles
            and metadata.max_seq_len <= (SHORT_CONTEXT if decode else SHORT_VERIFY_CONTEXT)):
        long_verify = (metadata.max_seq_len > LONG_VERIFY_CONTEXT
                       and metadata.num_seqs * num_kv_heads <= LONG_VERIFY_PROGRAMS)
        max_splits = MAX_SHORT_SPLITS if decode or long_verify else MAX_SHORT_VERIFY_SPLITS
        return DecodePlan(min(triton.next_power_of_2(tiles), max_splits), SHORT_DECODE_TILE)
    if (metadata.max_query_len == 1 and metadata.num_seqs >= WIDE_SHORT_BATCH and kv_cache_dtype.itemsize == 2
            and metadata.max_seq_len <= WIDE_SHORT_CONTEXT):
        return DecodePlan(1, SHORT_DECODE_TILE)
    return DecodePlan(choose_num_kv_splits(metadata, num_kv_heads, device))


def choose_num_kv_splits(metadata: PagedBatch, num_kv_heads: int, device: torch.device) -> int:
    """Split the context of decode and verify batches (a few query tokens per sequence)
    whose (sequence, KV head) programs would leave multiprocessors idle, up to about
    KV_SPLIT_WAVES programs per multiprocessor; 1 for other batches (a batch that fills
    the chip loses to the merge's extra traffic)."""
    if metadata.max_query_len > MAX_SPLIT_QUERY_LEN:
        return 1
    programs = metadata.num_seqs * num_kv_heads
    num_sms = device_info.num_sms(device)
    if programs >= num_sms:
        return 1
    wanted = math.ceil(KV_SPLIT_WAVES * num_sms / programs)
    return max(1, min(wanted, metadata.max_seq_len // MIN_KEYS_PER_SPLIT, MAX_KV_SPLITS))


def _float8_asm_format(kv_cache: torch.Tensor, query: torch.Tensor) -> str:
    """PTX name of a float8 cache's format where V converts through inline PTX (CUDA with
    fp16 dots); "" elsewhere (the interpreter runs no PTX)."""
    formats = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    if query.device.type != "cuda" or envs.TRITON_INTERPRET:
        return ""
    return formats.get(kv_cache.dtype, "") if query.dtype in (torch.float16, torch.bfloat16) else ""


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: PagedBatch,
    scale: float,
    output: torch.Tensor,
    num_kv_splits: int = 1,
    tile: TileConfig | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    new_kv: NewKV | None = None,
    tree_bits: torch.Tensor | None = None,
) -> None:
    """output[T, H, D] = causal attention of query [T, H, D] over each sequence's paged
    context in kv_cache [2, num_blocks, block_size, KVH, D] (a float8 cache holds K/V
    divided by kv_scales). Given new_kv (decode and verify batches on the short-context tile,
    a cache of the query's dtype), the query and the step's keys are unrotated: the kernel
    applies RoPE and stores the new keys and values at metadata.slot_mapping (fuses_new_kv).
    Given tree_bits ([T] int64, query_visibility_bits), each token sees only the step's
    tokens its bits name (token trees). Grid sizes come from the metadata's host-side fields
    only, so no device sync happens here."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0 and query.stride(-1) == 1 and output.stride(-1) == 1
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    tile = batch_tile(metadata, query.dtype, tile)
    if tile == SHORT_DECODE_TILE:
        block_m = short_tile_rows(metadata.max_query_len, group_pad)
    else:
        block_m = max(tile.block_m, group_pad)
    block_q = block_m // group_pad
    num_q_blocks = num_tokens // block_q + metadata.num_seqs
    if new_kv is None:
        key = value = cos = sin = query  # unused
    else:
        assert fuses_new_kv(metadata, tile, query.dtype, kv_cache.dtype, group), "not a batch the fused RoPE takes"
        key, value, cos, sin = new_kv
        assert key.stride(-1) == value.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    split = num_kv_splits > 1
    if split:
        partial = torch.empty(
            num_tokens, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=query.device
        )
        maxes = torch.empty(partial.shape[:-1], dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxes)
    else:
        partial, maxes, sums = output, output, output  # the extra two are unused
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_kv_splits)](
        partial,
        maxes,
        sums,
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        key,
        value,
        cos,
        sin,
        metadata.slot_mapping,
        metadata.slot_mapping if tree_bits is None else tree_bits,
        metadata.num_seqs,
        num_heads,
        num_kv_splits,
        scale * kv_scales[0] * LOG2_E,
        kv_scales[1],
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        output.stride(0),
        output.stride(1),
        metadata.block_tables.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=metadata.block_size,
        SPLIT=split,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        FP16_DOTS=kv_cache.element_size() == 1 and query.dtype == torch.bfloat16,
        V_FLOAT8_ASM=_float8_asm_format(kv_cache, query),
        EARLY_METADATA=tile in NARROW_DECODE_TILES,
        NEW_KV=new_kv is not None and metadata.max_query_len == 1,
        # The dot's smallest N is 16.
        NEW_KEYS=max(16, block_q) if new_kv is not None and metadata.max_query_len > 1 else 0,
        TREE=tree_bits is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl.chained_options(query.device),
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            output,
            partial,
            maxes,
            sums,
            num_heads,
            num_kv_splits,
            output.stride(0),
            output.stride(1),
            HEAD_DIM=head_dim,
            **pdl.chained_options(query.device),
        )


def warm_up(kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype, block_size: int,
            max_width: int = 1) -> int:
    """Launch every kernel variant a step may pick for this model's shapes and dtypes once,
    so that Triton compiles them (or loads them from its cache) at start-up rather than
    during the first requests that need them: decode tiles for few and for WIDE_BATCH
    sequences, verify-width prefill tiles, each unsplit and split, the merge, (16- and
    8-bit caches) the short-context plan's split tile, (16-bit caches) that tile unsplit for
    WIDE_SHORT_BATCH sequences, and (a cache of the run dtype) that tile taking RoPE and the
    cache write (new_kv); with speculative verify steps of up to max_width tokens a
    sequence, the short-context tile at each row count those widths give. kv_cache is a
    layer's cache [2, blocks, block_size, KVH, D] (read, not written: the new tokens' slots
    are padding). Returns the number of launches."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    device = kv_cache.device
    blocks = list(range(min(2, kv_cache.shape[1])))
    seq_len = len(blocks) * block_size
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # The narrowest verify width of each kernel variant: the short tile's row count, and
    # whether the whole width fits them (fused RoPE).
    verify_widths: dict[tuple[int, bool], int] = {}
    for width in range(2, max_width + 1):
        verify_widths.setdefault((short_tile_rows(width, group_pad), _whole_width_fits(width, group_pad)), width)
    default_plans = [DecodePlan(1), DecodePlan(2)]
    short_split = [DecodePlan(2, SHORT_DECODE_TILE)] if _short_plan_serves(kv_cache.dtype) else []
    # Wide batches of short contexts over a 16-bit cache: the short tile unsplit.
    short_unsplit = [DecodePlan(1, SHORT_DECODE_TILE)] if kv_cache.dtype.itemsize == 2 else []
    # (sequences, tokens each, plans)
    shapes = [(1, 1, default_plans + short_split + short_unsplit), (WIDE_BATCH, 1, default_plans),
              (1, 2, default_plans), *((1, width, short_split) for width in verify_widths.values())]
    launches = 0
    for num_seqs, query_len, plans in shapes:
        num_tokens = num_seqs * query_len
        # The query as the model hands it over: a view of the fused q/k/v projection's rows.
        query, key, value = torch.zeros(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype,
                                        device=device).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        cos = torch.zeros(num_tokens, head_dim // 2, dtype=torch.float32, device=device)
        new_kv = NewKV(key, value, cos, cos)
        starts = [i * query_len for i in range(num_seqs + 1)]
        metadata = PagedBatch(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
            block_tables=torch.tensor([blocks] * num_seqs, dtype=torch.int32, device=device),
            block_size=block_size, max_query_len=query_len, max_seq_len=seq_len,
            query_start_loc_cpu=starts, seq_lens_cpu=[seq_len] * num_seqs,
        )
        for plan in plans:
            fused = (False, True) if fuses_new_kv(metadata, plan.tile, dtype, kv_cache.dtype, group) else (False,)
            for with_new_kv in fused:
                output = torch.empty(query.shape, dtype=dtype, device=device)
                paged_attention(query, kv_cache, metadata, head_dim**-0.5, output, plan.num_kv_splits,
                                tile=plan.tile, new_kv=new_kv if with_new_kv else None)
                launches += 1
    return launches
