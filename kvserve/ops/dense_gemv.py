"""A decode step's one-row bf16/fp16 linears on Hopper: y = x W^T (+ b) for x [1, K], as a
programmatic dependent of the kernel before it (kvserve.ops.pdl).

cuBLAS's GEMV reads a small projection no faster than this kernel does alone (H200, weights
cycling past the L2, Qwen3-30B-A3B's q/k/v 5120 x 2048: 8.3 us against 6.3; its o_proj 2048
x 4096: 8.9 against 6.9; benchmarks/results/dense-gemv/), and it starts only once the
kernel before it has finished. Here each program loads its first weight tile (which nothing
in the step writes) before it waits for x, so the DRAM latency of the first loads overlaps
the previous kernel's tail; then one tile ahead. A narrow output over a long K splits K
(DenseTile.splits): the splits' fp32 sums are added in split order by the last of them to
arrive, so every launch shape gives the same result every run.

The RMSNorm between such a linear and a mixture of experts runs inside the two
(PendingNorm, RMSNorm.add_after), as the int4/fp8 kernels' do: the layer before the norm
adds its output to the residual stream and leaves the norm's sums of squares
(gemv_add_norm), the one after it scales its output by the norm's factor (gemv of a
PendingNorm). Each program of the layer after reads all of the sums (one per program of the
layer before: 512 for a 2048-wide hidden state at 4 rows a program, 2 KB of L2), issued
after its wait and added up after its loop. Between two of these GEMVs the norm keeps its
own kernel: measured faster (RMSNorm.add_after's _two_dense_gemvs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve import envs
from kvserve.ops import device as device_info
from kvserve.ops import pdl
from kvserve.ops.pending_norm import PendingNorm
from kvserve.ops.pending_norm_tiles import add_norm_store, load_norm_sums, row_scale_of
from kvserve.ops.split_k import arrives_last, rearm, split_counters, summed_splits

# The split-K sum's loads in flight at once (masked past the last split).
SPLITS_IN_FLIGHT: tl.constexpr = tl.constexpr(4)


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, pending_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr,
                       partial_ptr, count_ptr, N, K, k_per_split, stride_w, pending_partials, norm_eps,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                       ROW_SCALE: tl.constexpr, PARTIALS: tl.constexpr, ADD_NORM: tl.constexpr,
                       SPLIT: tl.constexpr):
    """out[n] = sum_k W[n, k] x[k] (+ bias[n]) for one BLOCK_N block of rows, in fp32, stored
    in out's dtype.

    Fused RMSNorms (PendingNorm): ROW_SCALE takes x = h * the norm's weight whose norm the
    previous linear left pending (pending_partials block sums of h^2 at pending_ptr) and
    scales y by rsqrt(mean(h^2) + eps) before the bias; ADD_NORM adds y to the residual
    stream in place and leaves the next norm pending in turn (add_norm_store: out = h * the
    norm's weight, this block's sum of h^2 at sum_squares_ptr[program]).

    SPLIT: grid axis 2 splits K into runs of k_per_split (whole tiles); each split leaves its
    fp32 sums in partial_ptr [splits, N], and the last of a row block's splits to arrive (an
    acq_rel counter at count_ptr, re-armed to 0) adds them up in split order (the same
    result every run) and finishes the block."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k_start = 0
    k_end = K
    if SPLIT:
        k_start = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
    offs = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + offs[None, :]
    # Weights are read once a step: evict_first keeps x and the activations in L2.
    w = tl.load(w_ptrs + k_start, mask=row_mask[:, None] & (k_start + offs < k_end)[None, :], other=0.0,
                eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()  # x (and a pending norm's sums, the residual) are earlier kernels' output
    x_row = tl.zeros((1,), dtype=tl.int32)  # the one row of x, as the norm helpers index rows
    norm_sums = tl.zeros((1, PARTIALS), dtype=tl.float32)
    if ROW_SCALE:
        # Loaded here, summed after the loop: the loads overlap the loop instead of stalling it.
        norm_sums = load_norm_sums(pending_ptr, x_row, x_row == 0, pending_partials, PARTIALS)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs, mask=k0 + offs < k_end, other=0.0).to(tl.float32)
        next_mask = row_mask[:, None] & (k0 + BLOCK_K + offs < k_end)[None, :]
        w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=next_mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)
    if SPLIT:
        if arrives_last((y,), partial_ptr, count_ptr, (rows,), (row_mask,), N):
            _finish(summed_splits(partial_ptr, rows, row_mask, N, SPLITS_IN_FLIGHT), rows, row_mask, x_row,
                    norm_sums, bias_ptr, out_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr, K, norm_eps,
                    HAS_BIAS, ROW_SCALE, ADD_NORM)
            rearm(count_ptr)
    else:
        _finish(y, rows, row_mask, x_row, norm_sums, bias_ptr, out_ptr, residual_ptr, norm_weight_ptr,
                sum_squares_ptr, K, norm_eps, HAS_BIAS, ROW_SCALE, ADD_NORM)


@triton.jit
def _finish(y, rows, row_mask, x_row, norm_sums, bias_ptr, out_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr,
            K, norm_eps, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, ADD_NORM: tl.constexpr):
    """A row block's sums y [BLOCK_N] to the output: the pending norm's factor, the bias, then
    stored, or added to the residual stream with the next norm left pending."""
    if ROW_SCALE:
        y *= tl.sum(row_scale_of(norm_sums, K, norm_eps))  # one row: its factor as a scalar
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if ADD_NORM:  # the output's rows are the norm's columns
        add_norm_store(y[None, :], x_row, rows, x_row == 0, row_mask, out_ptr, 0, residual_ptr, norm_weight_ptr,
                       sum_squares_ptr)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes x @ weight^T: one row of x on CUDA where `takes_row`."""
    return x.is_cuda and x.numel() == weight.shape[1] and takes_row(x.dtype, weight)


def takes_row(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes one row of x in `dtype` on weight's device: bf16/fp16 on a Hopper
    or newer GPU, weight contiguous in x's dtype. Whether PDL is on or not (KVSERVE_PDL=0), so
    that turning it off changes no result. KVSERVE_DENSE_GEMV=0 leaves every linear to cuBLAS
    (for side-by-side timing)."""
    return (weight.is_cuda and dtype in (torch.bfloat16, torch.float16) and weight.dtype == dtype
            and weight.is_contiguous() and envs.KVSERVE_DENSE_GEMV and not envs.TRITON_INTERPRET
            and device_info.hopper_or_newer(weight.device.index or 0))


class DenseTile(NamedTuple):
    """A launch's shape: rows and k columns a program's tile holds, and the splits of K
    (grid axis 2; 1: no split)."""

    block_n: int
    block_k: int
    splits: int = 1


def tile(n: int, k: int, device: torch.device) -> DenseTile:
    """From H200 sweeps whose calls cycle through more weight than the L2 holds
    (benchmarks/gpu_dense_gemv_sweep.py, results/dense-gemv/): over a short k (Qwen3-30B-A3B's
    q/k/v, 5120 x 2048) 4 x 512 tiles, each program four tiles long (7.6 -> 6.3 us against 8 x
    256); a narrow n over a long k (its o_proj, 2048 x 4096, which leaves the next norm
    pending) K split in 4 under 8 x 256 tiles, 1024 programs four tiles long (8.1 -> 7.4 us);
    otherwise 512-wide tiles of 8 rows where that still leaves 4 programs a multiprocessor, 4
    otherwise (Llama-3-8B's projections: no other shape measured clearly faster)."""
    if k <= 2048:
        return DenseTile(4, 512)
    if n <= 2048:
        return DenseTile(8, 256, 4)
    block_n = 8 if n // 8 >= 4 * device_info.num_sms(device) else 4
    return DenseTile(block_n, 512)


def gemv(x: torch.Tensor | PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block: tuple[int, ...] | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) for x [..., K] holding one row; weight [N, K]; the result in
    x's dtype and shape [..., N]. x a PendingNorm: its RMSNorm finished in the kernel (the
    output scaled). `block`: a DenseTile's fields instead of `tile`'s."""
    pending = x if isinstance(x, PendingNorm) else None
    x = x.rows if pending is not None else x
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, DenseTile(*block) if block else tile(n, k, x.device), pending=pending)
    return out


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                  block: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv` (no bias) followed by the residual add and RMSNorm after it, in the kernel's
    epilogue: residual [1, N] (contiguous, x's dtype) updated in place to h = residual +
    x W^T; returns (h * norm_weight [1, N], the programs' sums of h^2 [1, programs] fp32),
    a PendingNorm's rows and sums."""
    n, k = weight.shape
    shape = DenseTile(*block) if block else tile(n, k, x.device)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    sums = torch.empty(1, triton.cdiv(n, shape.block_n), dtype=torch.float32, device=x.device)
    _launch(x, weight, None, out, shape, add_norm=(residual, norm_weight, sums))
    return out, sums


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, shape: DenseTile,
            pending: PendingNorm | None = None,
            add_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One launch of the kernel for x's row into out; `pending`: x's norm to finish;
    `add_norm`: (residual, the norm's weight, sums) to leave the next one pending."""
    n, k = weight.shape
    x = x.reshape(k)  # a copy only where the row's elements are not adjacent
    block_n, block_k, splits = shape
    k_tiles = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(k_tiles, min(max(splits, 1), k_tiles)) * block_k
    splits = triton.cdiv(k, k_per_split)  # every split at least one tile
    row_blocks = triton.cdiv(n, block_n)
    counters, partial = out, out  # unused unless K is split
    if splits > 1:
        counters = split_counters(x.device)
        assert row_blocks <= counters.numel()
        partial = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    residual, norm_weight, sums = add_norm if add_norm is not None else (weight, weight, out)
    partials = pending.sums.shape[-1] if pending is not None else 1
    _dense_gemv_kernel[(row_blocks, 1, splits)](
        x, weight, bias if bias is not None else weight, out, pending.sums if pending is not None else out,
        residual, norm_weight, sums, partial, counters, n, k, k_per_split, weight.stride(0), partials,
        pending.eps if pending is not None else 0.0,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, ROW_SCALE=pending is not None,
        PARTIALS=triton.next_power_of_2(partials), ADD_NORM=add_norm is not None, SPLIT=splits > 1, num_warps=4,
        **pdl.chained_options(x.device),
    )
