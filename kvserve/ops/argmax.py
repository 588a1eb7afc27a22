"""Argmax over the vocabulary (greedy decoding, and the exponential-race sample). On CUDA two Triton kernels: torch's argmax reduces a
row of 128k logits in one thread block (28 us on an H100, 1% of a batch-1 int4 decode
step); here chunks of the row reduce in parallel, then one program a row picks the chunk.
Ties go to the first index and NaN counts as the maximum, as in torch.argmax (a row holding
both NaN and +inf returns the first of either)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # logits a program of the first kernel reduces


@triton.jit
def _chunk_argmax_kernel(logits_ptr, max_ptr, index_ptr, vocab, stride_row, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * num_chunks + chunk, value)
    tl.store(index_ptr + row * num_chunks + chunk, chunk * CHUNK + index)


@triton.jit
def _pick_chunk_kernel(max_ptr, index_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    maxima = tl.load(max_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=float("-inf"))
    _, best = tl.max(maxima, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(index_ptr + row * num_chunks + best).to(tl.int64))


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> int64 [rows], the index of each row's maximum (torch.argmax's
    result); Triton kernels on CUDA, torch elsewhere."""
    if not logits.is_cuda or logits.dim() != 2 or logits.stride(-1) != 1 or logits.numel() == 0:
        return logits.argmax(dim=-1)
    return triton_argmax(logits)


def triton_argmax(logits: torch.Tensor) -> torch.Tensor:
    """row_argmax's kernels, on any device Triton runs on (the interpreter included)."""
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    maxima = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](logits, maxima, indices, vocab, logits.stride(0), num_chunks,
                                             CHUNK=CHUNK, num_warps=8)
    _pick_chunk_kernel[(rows,)](maxima, indices, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks),
                                num_warps=1)
    return out
