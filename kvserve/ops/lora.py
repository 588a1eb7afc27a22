"""LoRA shrink and expand on CUDA (BGMV-style: each token reads its own slot's matrices, chosen
by a per-token slot index read on the device, so a CUDA graph replays any mix of adapters).

shrink: h[t, j] = sum_k x[t, k] * A[slot[t], j, k]                  (j over slices x rank)
expand: y[t, offset + o] += sum_r h[t, slice x rank + r] * B[o, slot[t] x rank + r]

A is the LoRA layer's [slots, slices x rank, in] buffer, B one slice's [out, slots x rank];
tokens of slot -1 (the base model) are left as they are. h is fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SHRINK_BLOCK_N = 16
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_OUT = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, in_features, num_rows, stride_x, stride_a_slot,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        for start in range(0, in_features, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_x + cols, mask=cols < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_a_slot + rows[:, None] * in_features + cols[None, :],
                        mask=(rows[:, None] < num_rows) & (cols[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + token * num_rows + rows, acc, mask=rows < num_rows)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, rank, num_slot_cols, out_features, stride_h, h_offset,
                   stride_y, y_offset, BLOCK_OUT: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        ranks = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + token * stride_h + h_offset + ranks, mask=ranks < rank, other=0.0)
        b = tl.load(b_ptr + outs[:, None] * num_slot_cols + slot * rank + ranks[None, :],
                    mask=(outs[:, None] < out_features) & (ranks[None, :] < rank), other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_y + y_offset + outs
        y = tl.load(y_ptrs, mask=outs < out_features, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=outs < out_features)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], lora_a [slots, rows, in] (contiguous), slots int [>= T] -> h [T, rows] fp32."""
    num_tokens, in_features = x.shape
    num_rows = lora_a.shape[1]
    h = torch.empty(num_tokens, num_rows, dtype=torch.float32, device=x.device)
    grid = (num_tokens, triton.cdiv(num_rows, SHRINK_BLOCK_N))
    _shrink_kernel[grid](x, lora_a, slots, h, in_features, num_rows, x.stride(0), lora_a.stride(0),
                         BLOCK_N=SHRINK_BLOCK_N, BLOCK_K=SHRINK_BLOCK_K)
    return h


def lora_expand(h: torch.Tensor, h_offset: int, lora_b: torch.Tensor, rank: int, slots: torch.Tensor,
                y: torch.Tensor, y_offset: int) -> None:
    """y[:, y_offset : y_offset + out] += each token's h[:, h_offset : h_offset + rank] @ its
    slot's B^T, in place; lora_b [out, slots x rank] (contiguous)."""
    num_tokens = h.shape[0]
    out_features = lora_b.shape[0]
    grid = (num_tokens, triton.cdiv(out_features, EXPAND_BLOCK_OUT))
    _expand_kernel[grid](h, lora_b, slots, y, rank, lora_b.shape[1], out_features, h.stride(0), h_offset,
                         y.stride(0), y_offset, BLOCK_OUT=EXPAND_BLOCK_OUT, BLOCK_R=triton.next_power_of_2(rank))
