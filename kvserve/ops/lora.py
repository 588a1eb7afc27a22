"""LoRA shrink and expand on CUDA, chosen by a per-token slot index read on the device, so a
CUDA graph replays any mix of adapters: per token for a few tokens (BGMV-style: each token
reads its own slot's matrices), grouped by slot for many (SGMV-style, below).

shrink: h[t, j] = sum_k x[t, k] * A[slot[t], j, k]                  (j over slices x rank)
expand: y[t, offset + o] += sum_r h[t, slice x rank + r] * B[o, slot[t] x rank + r]

A is the LoRA layer's [slots, slices x rank, in] buffer, B one slice's [out, slots x rank];
tokens of slot -1 (the base model) are left as they are. h is fp32."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve.ops import device as device_info
from kvserve.ops.fused_moe import align_by_expert

SHRINK_BLOCK_N = 16
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_OUT = 128
# Slices of a fused projection expanded by one launch (q/k/v: 3).
MAX_SLICES = 3
# The shrinks split k over more programs when a step has few (at most this many splits, each
# at least this many BLOCK_K blocks long). The per-token shrink of a decode step reads A
# cold from HBM: a program looping over blocks waits out each load's latency in turn (H200,
# llama3-8b batch 1: down_proj's shrink took 9.3 us in 16 splits of 7 blocks), so it splits
# down to one block a program.
MAX_SPLITS = 16
MIN_K_BLOCKS_A_SPLIT = 4
PER_TOKEN_MAX_SPLITS = 128
PER_TOKEN_MIN_K_BLOCKS = 1


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, in_features, num_rows, k_per_split, stride_x, stride_a_slot,
                   stride_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's h[split][rows of one BLOCK_N slice] = x[the split's k] @ A[slot][rows, the
    split's k]^T (split: the third grid axis; the expand sums them)."""
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, in_features)
        for start in range(k_start, k_end, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_x + cols, mask=cols < k_end, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_a_slot + rows[:, None] * in_features + cols[None, :],
                        mask=(rows[:, None] < num_rows) & (cols[None, :] < k_end), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + split * stride_split + token * num_rows + rows, acc, mask=rows < num_rows)


@triton.jit
def _slice_of(pid_n, b0, b1, b2, size0, size1, size2, y_offset1, y_offset2, BLOCK_N: tl.constexpr):
    """The slice a column tile lies in (tiles numbered slice after slice; absent slices have
    size 0): its B, its size, its index and y offset, and the tile within it."""
    tiles0 = tl.cdiv(size0, BLOCK_N)
    tiles01 = tiles0 + tl.cdiv(size1, BLOCK_N)
    in1 = (pid_n >= tiles0) & (pid_n < tiles01)
    in2 = pid_n >= tiles01
    size = tl.where(in2, size2, tl.where(in1, size1, size0))
    index = in1.to(tl.int32) + 2 * in2.to(tl.int32)
    y_offset = tl.where(in2, y_offset2, tl.where(in1, y_offset1, 0))
    tile = pid_n - tl.where(in2, tiles01, tl.where(in1, tiles0, 0))
    b_ptr = b0
    if in1:
        b_ptr = b1
    if in2:
        b_ptr = b2
    return b_ptr, size, index, y_offset, tile


@triton.jit
def _expand_kernel(h_ptr, b0, b1, b2, slots_ptr, y_ptr, rank, num_slots, size0, size1, size2, y_offset0, y_offset1,
                   y_offset2, h_offset0, stride_h, stride_split, num_splits, stride_y, BLOCK_OUT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One token's y[one BLOCK_OUT column tile of one slice] += h[that slice's rank columns]
    @ B[slice][:, slot's columns]^T, for up to three slices in one launch; h the sum of the
    shrink's splits."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        b_ptr, size, index, y_offset, tile = _slice_of(tl.program_id(1), b0, b1, b2, size0, size1, size2,
                                                       y_offset1, y_offset2, BLOCK_OUT)
        outs = tile * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        ranks = tl.arange(0, BLOCK_R)
        # The shrink's partial sums over k, loaded at once and summed in a fixed order.
        splits = tl.arange(0, BLOCK_S)
        partials = tl.load(h_ptr + splits[:, None] * stride_split + token * stride_h + h_offset0 + index * rank
                           + ranks[None, :], mask=(splits[:, None] < num_splits) & (ranks[None, :] < rank),
                           other=0.0)
        h = tl.sum(partials, axis=0)
        b = tl.load(b_ptr + outs[:, None] * (num_slots * rank) + slot * rank + ranks[None, :],
                    mask=(outs[:, None] < size) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_y + y_offset0 + y_offset + outs
        y = tl.load(y_ptrs, mask=outs < size, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=outs < size)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, num_splits: int | None = None
                ) -> torch.Tensor:
    """x [T, in], lora_a [slots, rows, in] (contiguous), slots int [>= T] -> h [splits, T, rows]
    fp32 partial sums over k (the expand adds them up). `num_splits` of k: by default enough
    for about two programs an SM (a few tokens of a long k, as down_proj's, would otherwise
    run few long programs)."""
    num_tokens, in_features = x.shape
    num_rows = lora_a.shape[1]
    n_tiles = triton.cdiv(num_rows, SHRINK_BLOCK_N)
    num_splits, k_per_split = _k_splits(in_features, SHRINK_BLOCK_K, num_tokens * n_tiles, x.device, num_splits,
                                        PER_TOKEN_MAX_SPLITS, PER_TOKEN_MIN_K_BLOCKS)
    h = torch.empty(num_splits, num_tokens, num_rows, dtype=torch.float32, device=x.device)
    grid = (num_tokens, n_tiles, num_splits)
    _shrink_kernel[grid](x, lora_a, slots, h, in_features, num_rows, k_per_split, x.stride(0), lora_a.stride(0),
                         h.stride(0), BLOCK_N=SHRINK_BLOCK_N, BLOCK_K=SHRINK_BLOCK_K)
    return h


def _k_splits(in_features: int, block_k: int, num_programs: int, device: torch.device, num_splits: int | None,
              max_splits: int = MAX_SPLITS, min_blocks: int = MIN_K_BLOCKS_A_SPLIT) -> tuple[int, int]:
    """(splits, k a split) for a shrink of `num_programs` programs a split: `num_splits` if
    given, else enough for about two programs an SM, each split `min_blocks` blocks long at
    least, `max_splits` at most; shape-static (the same on every graph replay)."""
    k_blocks = triton.cdiv(in_features, block_k)
    if num_splits is None:
        wanted = triton.cdiv(2 * device_info.num_sms(device, off_gpu=132), num_programs)
        num_splits = max(1, min(wanted, k_blocks // min_blocks, max_splits))
    k_per_split = triton.cdiv(k_blocks, num_splits) * block_k
    return triton.cdiv(in_features, k_per_split), k_per_split  # no split empty


def lora_expand_slices(h: torch.Tensor, lora_bs: Sequence[torch.Tensor], rank: int, slots: torch.Tensor,
                       y: torch.Tensor, h_offset: int = 0, y_offset: int = 0) -> None:
    """y += each token's h @ its slot's B^T for up to three slices in one launch (in place;
    each B [out, slots x rank], contiguous): slice i's rank columns of h from
    h_offset + i x rank, its columns of y after slice i - 1's from y_offset. h [splits, T,
    rows] (lora_shrink's partial sums)."""
    assert h.stride(2) == 1 and y.stride(1) == 1
    num_splits, num_tokens = h.shape[:2]
    num_slots = lora_bs[0].shape[1] // rank
    b, size, offset = _padded_slices(lora_bs)
    grid = (num_tokens, sum(triton.cdiv(s, EXPAND_BLOCK_OUT) for s in size))
    _expand_kernel[grid](h, *b, slots, y, rank, num_slots, *size, y_offset, offset[1], offset[2], h_offset,
                         h.stride(1), h.stride(0), num_splits, y.stride(0), BLOCK_OUT=EXPAND_BLOCK_OUT,
                         BLOCK_R=triton.next_power_of_2(rank), BLOCK_S=triton.next_power_of_2(num_splits))


def _padded_slices(lora_bs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Up to three slices' B, sizes and y offsets (from the first's), as the expand kernels
    take them: absent slices of size 0."""
    assert 1 <= len(lora_bs) <= MAX_SLICES and all(b.is_contiguous() for b in lora_bs)
    sizes = [b.shape[0] for b in lora_bs]
    offsets = [0, *itertools.accumulate(sizes)][:len(sizes)]
    missing = MAX_SLICES - len(lora_bs)
    return [*lora_bs, *[lora_bs[0]] * missing], sizes + [0] * missing, offsets + [0] * missing


# ---- SGMV: many tokens, grouped by slot ------------------------------------------------------
# A step of many tokens (prefill chunks) takes grouped GEMMs instead: the tokens are sorted by
# slot on the device and each slot's run padded to BLOCK_M (align_by_slot), so every BLOCK_M
# tile of the sorted list belongs to one slot and one program multiplies the tile's rows by
# that slot's matrices on the tensor cores, each slot's A and B read once a tile rather than
# once a token. Base tokens sort into a run of their own whose tiles exit at once.

SGMV_EXPAND_BLOCK_N = 128
SGMV_SHRINK_BLOCK_K = 64


def sgmv_block_m(num_tokens: int) -> int:
    """Rows of a tile: small steps keep more programs (fewer tokens a slot)."""
    return 16 if num_tokens < 512 else 32


class SlotGroups(NamedTuple):
    """A step's tokens grouped by slot (align_by_slot)."""

    sorted_tokens: torch.Tensor  # token indices grouped by slot, each run padded with num_tokens
    block_slots: torch.Tensor  # each BLOCK_M tile's slot (num_slots: base tokens; past the end: more)
    num_padded: torch.Tensor  # 1 element: the padded length
    block_m: int


def align_by_slot(slots: torch.Tensor, num_tokens: int, num_slots: int) -> SlotGroups:
    """The first num_tokens of `slots` (-1: base) grouped by slot on the device (fused MoE's
    align_by_expert with the slots as experts and the base model as one more): two launches,
    shapes from num_tokens alone, no host reads, so a CUDA graph replays it for any slots."""
    block_m = sgmv_block_m(num_tokens)
    # -1 -> num_slots (remainder takes the divisor's sign).
    chosen = slots[:num_tokens].remainder(num_slots + 1).view(num_tokens, 1)
    sorted_tokens, block_slots, num_padded = align_by_expert(chosen, num_slots + 1, block_m)
    return SlotGroups(sorted_tokens, block_slots, num_padded, block_m)


@triton.jit(do_not_specialize=["num_tokens"])
def _sgmv_shrink_kernel(x_ptr, a_ptr, sorted_ptr, block_slots_ptr, num_padded_ptr, h_ptr, num_tokens, num_slots,
                        in_features, num_rows, k_per_split, stride_x, stride_a_slot, stride_h, stride_split,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """h[split][tokens of one tile, rows of one BLOCK_N slice] = x[tokens, the split's k] @
    A[slot][rows, the split's k]^T (split: the third grid axis; the expand sums them)."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slots_ptr + pid_m)
    if slot >= num_slots:
        return
    tokens = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = tokens < num_tokens
    tokens = tl.where(valid, tokens, 0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    ks = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    a_ptrs = a_ptr + slot * stride_a_slot + rows[None, :] * in_features + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        k_mask = ks < k_end
        x = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=(rows[None, :] < num_rows) & k_mask[:, None], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
        ks += BLOCK_K
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    tl.store(h_ptr + split * stride_split + tokens[:, None] * stride_h + rows[None, :], acc,
             mask=valid[:, None] & (rows[None, :] < num_rows))


@triton.jit(do_not_specialize=["num_tokens"])
def _sgmv_expand_kernel(h_ptr, b0, b1, b2, sorted_ptr, block_slots_ptr, num_padded_ptr, y_ptr, num_tokens,
                        num_slots, rank, size0, size1, size2, y_offset0, y_offset1, y_offset2, h_offset0, stride_h,
                        stride_split, num_splits, stride_y, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[tokens of one tile, one BLOCK_N column tile of one slice] += h[tokens, that slice's
    rank columns] @ B[slice][:, slot's columns]^T, for up to three slices in one launch; h
    the sum of the shrink's splits."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(block_slots_ptr + pid_m)
    if slot >= num_slots:
        return
    b_ptr, size, index, y_offset, tile = _slice_of(tl.program_id(1), b0, b1, b2, size0, size1, size2, y_offset1,
                                                   y_offset2, BLOCK_N)
    y_offset += y_offset0
    tokens = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = tokens < num_tokens
    tokens = tl.where(valid, tokens, 0)
    outs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + tokens[:, None] * stride_h + h_offset0 + index * rank + ranks[None, :]
    h_mask = valid[:, None] & (ranks[None, :] < rank)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(num_splits):  # the shrink's partial sums over k, in a fixed order
        h += tl.load(h_ptrs + split * stride_split, mask=h_mask, other=0.0)
    b = tl.load(b_ptr + outs[None, :] * (num_slots * rank) + slot * rank + ranks[:, None],
                mask=(outs[None, :] < size) & (ranks[:, None] < rank), other=0.0).to(tl.float32)
    delta = tl.dot(h, b, input_precision=PRECISION)
    mask = valid[:, None] & (outs[None, :] < size)
    y_ptrs = y_ptr + tokens[:, None] * stride_y + y_offset + outs[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 models get fp32 products (tl.dot would round them to tf32).
    return "ieee" if dtype == torch.float32 else "tf32"


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, groups: SlotGroups, num_splits: int | None = None
                ) -> torch.Tensor:
    """x [T, in], lora_a [slots, rows, in] (contiguous) -> h [splits, T, rows] fp32 partial
    sums over k (sgmv_expand adds them up), over the tokens `groups` sorted; the rows of base
    tokens are left unwritten. `num_splits` of k: by default enough for about two programs
    an SM (a step of few tokens or a long k, as down_proj's, would run few long programs)."""
    num_tokens, in_features = x.shape
    num_slots, num_rows = lora_a.shape[:2]
    assert x.stride(1) == 1 and lora_a.is_contiguous()
    block_m, block_k = groups.block_m, SGMV_SHRINK_BLOCK_K
    block_n = max(16, min(64, triton.next_power_of_2(num_rows))) if num_tokens >= 512 else 16
    num_tiles = groups.sorted_tokens.shape[0] // block_m
    n_tiles = triton.cdiv(num_rows, block_n)
    num_splits, k_per_split = _k_splits(in_features, block_k, num_tiles * n_tiles, x.device, num_splits)
    h = torch.empty(num_splits, num_tokens, num_rows, dtype=torch.float32, device=x.device)
    grid = (num_tiles, n_tiles, num_splits)
    _sgmv_shrink_kernel[grid](x, lora_a, groups.sorted_tokens, groups.block_slots, groups.num_padded, h, num_tokens,
                              num_slots, in_features, num_rows, k_per_split, x.stride(0), lora_a.stride(0),
                              h.stride(1), h.stride(0), PRECISION=_precision(x.dtype), BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return h


def sgmv_expand(h: torch.Tensor, lora_bs: Sequence[torch.Tensor], rank: int, groups: SlotGroups, y: torch.Tensor,
                h_offset: int = 0, y_offset: int = 0) -> None:
    """y[:, y_offset:] += per slice i (up to three, one launch): each token's
    h[:, h_offset + i x rank : + rank] @ its slot's B_i^T into the columns after slice i - 1's;
    h [splits, T, rows] (sgmv_shrink's partial sums); lora_bs[i] [out_i, slots x rank]
    (contiguous); base tokens left as they are."""
    assert h.stride(2) == 1 and y.stride(1) == 1
    num_splits, num_tokens = h.shape[:2]
    num_slots = lora_bs[0].shape[1] // rank
    b, size, offset = _padded_slices(lora_bs)
    block_m, block_n = groups.block_m, SGMV_EXPAND_BLOCK_N
    grid = (groups.sorted_tokens.shape[0] // block_m, sum(triton.cdiv(s, block_n) for s in size))
    _sgmv_expand_kernel[grid](h, *b, groups.sorted_tokens, groups.block_slots, groups.num_padded, y, num_tokens,
                              num_slots, rank, *size, y_offset, offset[1], offset[2], h_offset, h.stride(1),
                              h.stride(0), num_splits, y.stride(0), PRECISION=_precision(y.dtype), BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)), num_warps=4)
