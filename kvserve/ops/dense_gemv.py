"""A decode step's one-row bf16/fp16 linears on Hopper: y = x W^T (+ b) for x [1, K], as a
programmatic dependent of the kernel before it (kvserve.ops.pdl).

cuBLAS's GEMV reads a small projection about as fast as this kernel does alone (H200,
Qwen3-30B-A3B's q/k/v 5120 x 2048: 6.4 us against 6.3; its o_proj 2048 x 4096: 7.1 with
cuBLAS's split-K reduce against 6.3; benchmarks/results/fused-moe/decode-kernels-h200.txt),
but it starts only once the kernel before it has finished. Here each program loads its
first weight tile (which nothing in the step writes) before it waits for x, so the DRAM
latency of the first loads overlaps the previous kernel's tail; then one tile ahead. One
fp32 sum a row, no split of K: the same result every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve import envs
from kvserve.ops import device as device_info
from kvserve.ops import pdl


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[n] = sum_k W[n, k] x[k] (+ bias[n]) for one BLOCK_N block of rows, in fp32, stored
    in out's dtype."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + offs[None, :]
    # Weights are read once a step: evict_first keeps x and the activations in L2.
    w = tl.load(w_ptrs, mask=row_mask[:, None] & (offs < K)[None, :], other=0.0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        next_mask = row_mask[:, None] & (k0 + BLOCK_K + offs < K)[None, :]
        w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=next_mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` takes x @ weight^T: one row of bf16/fp16 on a Hopper or newer GPU,
    weight contiguous in x's dtype. Whether PDL is on or not (KVSERVE_PDL=0), so that turning
    it off changes no result. KVSERVE_DENSE_GEMV=0 leaves every linear to cuBLAS (for
    side-by-side timing)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.numel() == weight.shape[1] and weight.is_contiguous() and envs.KVSERVE_DENSE_GEMV
            and not envs.TRITON_INTERPRET and device_info.hopper_or_newer(x.device.index or 0))


def tile(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): 256-wide k tiles along k up to 2048, 512 past it; 8 rows a program
    where that still leaves 4 programs a multiprocessor, 4 otherwise (H200 sweep in
    decode-kernels-h200.txt: 5120 x 2048 best at 8 x 256, 2048 x 4096 at 4 x 512)."""
    block_k = 256 if k <= 2048 else 512
    block_n = 8 if n // 8 >= 4 * device_info.num_sms(device) else 4
    return block_n, block_k


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block: tuple[int, int] | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) for x [..., K] holding one row; weight [N, K]; the result in
    x's dtype and shape [..., N]. `block`: (BLOCK_N, BLOCK_K) instead of `tile`'s."""
    n, k = weight.shape
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    x = x.reshape(k)  # a copy only where the row's elements are not adjacent
    block_n, block_k = block or tile(n, k, x.device)
    _dense_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl.chained_options(x.device),
    )
    return out
