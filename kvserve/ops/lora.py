"""LoRA shrink and expand on CUDA, chosen by a per-token slot index read on the device (so a
CUDA graph replays any mix of adapters):

shrink: h[t, j] = sum_k x[t, k] * A[slot[t], j, k]                  (j over slices x rank)
expand: y[t, offset + o] += sum_r h[t, slice x rank + r] * B[o, slot[t] x rank + r]

A is the LoRA layer's [slots, slices x rank, in] buffer, B one slice's [out, slots x rank];
tokens of slot -1 (the base model) are left as they are. h is fp32.

Two forms. BGMV (few tokens): one program per token, reading its slot's matrices. SGMV
(many tokens, Punica's segmented form): the step's tokens grouped by slot on the device
(group_by_slot, the fused MoE's alignment with slots as experts), each program a tile of
one slot's tokens through tensor-core dots, so a slot's A and B are read once a tile rather
than once a token."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve.ops.fused_moe import align_by_expert

SHRINK_BLOCK_N = 16
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_OUT = 128
# SGMV tiles: tokens of one slot a program (the dot's smallest M is 16), and of A's rows.
SGMV_BLOCK_M = 32
SGMV_SHRINK_BLOCK_N = 16
SGMV_SHRINK_BLOCK_K = 128
SGMV_EXPAND_BLOCK_OUT = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, in_features, num_rows, num_tokens, k_per_split, stride_x,
                   stride_a_slot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        k_start = split * k_per_split
        for start in range(k_start, tl.minimum(k_start + k_per_split, in_features), BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_x + cols, mask=cols < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_a_slot + rows[:, None] * in_features + cols[None, :],
                        mask=(rows[:, None] < num_rows) & (cols[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + (split * num_tokens + token) * num_rows + rows, acc, mask=rows < num_rows)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, rank, num_slot_cols, out_features, num_splits, stride_h_split,
                   stride_h, h_offset, stride_y, y_offset, BLOCK_OUT: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        ranks = tl.arange(0, BLOCK_R)
        # The shrink's split-K partials, summed in a fixed order (deterministic).
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for split in range(num_splits):
            h += tl.load(h_ptr + split * stride_h_split + token * stride_h + h_offset + ranks, mask=ranks < rank,
                         other=0.0)
        b = tl.load(b_ptr + outs[:, None] * num_slot_cols + slot * rank + ranks[None, :],
                    mask=(outs[:, None] < out_features) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_y + y_offset + outs
        y = tl.load(y_ptrs, mask=outs < out_features, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=outs < out_features)


# Split-K of the per-token shrink: few tokens give few programs (a token's rows / 16), each
# looping over all input columns; splitting the columns gives about this many programs.
SHRINK_TARGET_PROGRAMS = 256


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], lora_a [slots, rows, in] (contiguous), slots int [>= T] -> h [splits, T,
    rows] fp32: partial sums over column ranges (split-K), which lora_expand adds up."""
    num_tokens, in_features = x.shape
    num_rows = lora_a.shape[1]
    row_blocks = triton.cdiv(num_rows, SHRINK_BLOCK_N)
    max_splits = triton.cdiv(in_features, SHRINK_BLOCK_K)
    splits = max(1, min(max_splits, triton.cdiv(SHRINK_TARGET_PROGRAMS, max(1, num_tokens * row_blocks))))
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    splits = triton.cdiv(in_features, k_per_split)
    h = torch.empty(splits, num_tokens, num_rows, dtype=torch.float32, device=x.device)
    grid = (num_tokens, row_blocks, splits)
    _shrink_kernel[grid](x, lora_a, slots, h, in_features, num_rows, num_tokens, k_per_split, x.stride(0),
                         lora_a.stride(0), BLOCK_N=SHRINK_BLOCK_N, BLOCK_K=SHRINK_BLOCK_K)
    return h


def lora_expand(h: torch.Tensor, h_offset: int, lora_b: torch.Tensor, rank: int, slots: torch.Tensor,
                y: torch.Tensor, y_offset: int) -> None:
    """y[:, y_offset : y_offset + out] += each token's h[:, :, h_offset : h_offset + rank]
    (summed over the splits) @ its slot's B^T, in place; lora_b [out, slots x rank]
    (contiguous)."""
    num_splits, num_tokens = h.shape[:2]
    out_features = lora_b.shape[0]
    grid = (num_tokens, triton.cdiv(out_features, EXPAND_BLOCK_OUT))
    _expand_kernel[grid](h, lora_b, slots, y, rank, lora_b.shape[1], out_features, num_splits, h.stride(0),
                         h.stride(1), h_offset, y.stride(0), y_offset, BLOCK_OUT=EXPAND_BLOCK_OUT,
                         BLOCK_R=triton.next_power_of_2(rank))


class SlotGroups(NamedTuple):
    """A step's tokens grouped by slot: token indices in runs of one slot, each run padded to
    SGMV_BLOCK_M with the sentinel num_tokens; the slot of each block (>= the slot count:
    base-model tokens or past the end, skipped)."""

    sorted_tokens: torch.Tensor
    block_slots: torch.Tensor
    num_tokens: int


def group_by_slot(slots: torch.Tensor, num_tokens: int, num_slots: int) -> SlotGroups:
    """slots int [>= num_tokens] (-1: the base model) -> SlotGroups, on the device, no host
    read (shapes depend on num_tokens alone: capturable in a CUDA graph)."""
    chosen = torch.where(slots[:num_tokens] < 0, num_slots, slots[:num_tokens])
    sorted_tokens, block_slots, _ = align_by_expert(chosen[:, None], num_slots + 1, SGMV_BLOCK_M)
    return SlotGroups(sorted_tokens, block_slots, num_tokens)


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, sorted_ptr, block_slots_ptr, h_ptr, num_tokens, num_slots, in_features,
                        num_rows, stride_x, stride_a_slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    if slot < num_slots:
        tokens = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = tokens < num_tokens
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, in_features, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tokens[:, None] * stride_x + cols[None, :],
                        mask=valid[:, None] & (cols[None, :] < in_features), other=0.0)
            a = tl.load(a_ptr + slot * stride_a_slot + rows[None, :] * in_features + cols[:, None],
                        mask=(rows[None, :] < num_rows) & (cols[:, None] < in_features), other=0.0)
            acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
        tl.store(h_ptr + tokens[:, None] * num_rows + rows[None, :], acc,
                 mask=valid[:, None] & (rows[None, :] < num_rows))


@triton.jit
def _sgmv_expand_kernel(h_ptr, b_ptr, sorted_ptr, block_slots_ptr, y_ptr, num_tokens, num_slots, rank,
                        num_slot_cols, out_features, stride_h, h_offset, stride_y, y_offset,
                        BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block)
    if slot < num_slots:
        tokens = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = tokens < num_tokens
        ranks = tl.arange(0, BLOCK_R)
        outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        b = tl.load(b_ptr + outs[None, :] * num_slot_cols + slot * rank + ranks[:, None],
                    mask=(ranks[:, None] < rank) & (outs[None, :] < out_features), other=0.0)
        # h in B's dtype for the dot (as Punica and vLLM's expand do): fp32 models keep fp32.
        h = tl.load(h_ptr + tokens[:, None] * stride_h + h_offset + ranks[None, :],
                    mask=valid[:, None] & (ranks[None, :] < rank), other=0.0).to(b.dtype)
        delta = tl.dot(h, b, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + tokens[:, None] * stride_y + y_offset + outs[None, :]
        y_mask = valid[:, None] & (outs[None, :] < out_features)
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_mask)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """lora_shrink over tokens grouped by slot: x [T, in], lora_a [slots, rows, in]
    (contiguous) -> h [T, rows] fp32 (rows of base-model tokens left unset)."""
    num_tokens, in_features = x.shape
    num_slots, num_rows = lora_a.shape[:2]
    h = torch.empty(num_tokens, num_rows, dtype=torch.float32, device=x.device)
    grid = (groups.block_slots.shape[0], triton.cdiv(num_rows, SGMV_SHRINK_BLOCK_N))
    _sgmv_shrink_kernel[grid](x, lora_a, groups.sorted_tokens, groups.block_slots, h, num_tokens, num_slots,
                              in_features, num_rows, x.stride(0), lora_a.stride(0), BLOCK_M=SGMV_BLOCK_M,
                              BLOCK_N=SGMV_SHRINK_BLOCK_N, BLOCK_K=SGMV_SHRINK_BLOCK_K,
                              DOT_PRECISION=_dot_precision(x.dtype))
    return h


def sgmv_expand(h: torch.Tensor, h_offset: int, lora_b: torch.Tensor, rank: int, num_slots: int,
                groups: SlotGroups, y: torch.Tensor, y_offset: int) -> None:
    """lora_expand over tokens grouped by slot, in place; lora_b [out, slots x rank]."""
    out_features = lora_b.shape[0]
    grid = (groups.block_slots.shape[0], triton.cdiv(out_features, SGMV_EXPAND_BLOCK_OUT))
    _sgmv_expand_kernel[grid](h, lora_b, groups.sorted_tokens, groups.block_slots, y, groups.num_tokens, num_slots,
                              rank, lora_b.shape[1], out_features, h.stride(0), h_offset, y.stride(0), y_offset,
                              BLOCK_M=SGMV_BLOCK_M, BLOCK_OUT=SGMV_EXPAND_BLOCK_OUT,
                              BLOCK_R=max(16, triton.next_power_of_2(rank)), DOT_PRECISION=_dot_precision(y.dtype))
