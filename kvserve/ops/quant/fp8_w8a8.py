"""fp8 x fp8 matmul on the fp8 tensor cores for decode batches of 2-128 rows:
y = (x_q @ W_q^T) * x_scale[m] * w_scale[n], x quantized per token
(fp8_activation.quantize_per_token), W per output channel.

At those rows the weight-only kernels convert every e4m3 weight to bf16 in the loop (a
llama3-8b step's linears on an H100: 4.1-5.5 ms at 2-16 rows on mma.sync, 5.8-6.7 ms at
17-64 on tl.dot tiles), and cuBLAS (`torch._scaled_mm`) runs one 128 x 128 tile per
program, so o_proj and down are 32 programs on 132 SMs, each reading all of K (BENCHMARKS.md,
"Kernel level (GPU)": a step's linears by kernel at 2-128 rows). Here the e4m3 tiles go to
the tensor cores as loaded, the row tiles of a column block run next to each other (the
weight tile comes from DRAM once), and K is split until the GPU is full; the splits' fp32
partials are summed inside the kernel in split order by the last split of each output tile
(tiles.store_output), so the result does not depend on which split finishes first. x may
come quantized from the kernel before the linear (Fp8Rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.quant.weight_only.configs import LaunchConfig
from kvserve.ops.quant.weight_only.matmul import split_k
from kvserve.ops.quant.weight_only.tiles import split_tiles, store_output
from kvserve.ops.split_k import split_counters


@triton.jit
def fp8_w8a8_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, stride_xm, stride_wn, stride_om, stride_ps,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    # Grid (column blocks x row blocks, 1, splits of K), the row blocks of a column block
    # adjacent in launch order: they read the same weight tiles at about the same time.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    first, last = split_tiles(num_tiles, tiles_per_split, False)
    kk = first * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + kk[None, :]
    # SWAP_AB computes the transposed tile, W x^T: the weight's columns fill the tensor
    # cores' M (at least 64 on Hopper's wgmma) and a few rows of x their N (8 and up).
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(first, last):
        x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        # Weights are read once per step: keep them from evicting the activations and partials.
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0, eviction_policy="evict_first")
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    # Both scales commute with the sum over K: each split scales its own partial.
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    offs = rows[:, None] * stride_om + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    store_output((acc,), (offs,), (mask,), partial_ptr, out_ptr, count_ptr, stride_ps, SPLIT)


def fp8_w8a8_matmul(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
    config: LaunchConfig, out_dtype: torch.dtype = torch.bfloat16, swap_ab: bool | None = None,
) -> torch.Tensor:
    """x_fp8 [M, K] float8_e4m3fn with x_scale [M] (or [M, 1]) fp32, qweight [N, K]
    float8_e4m3fn with w_scale [N] (or [N, 1]) fp32 -> [M, N] in out_dtype. K must be whole
    config.block_k tiles; config's tile, warps, stages, waves and split_k apply (not its
    `words` or `even_splits`). swap_ab (default: row tiles under 64, wgmma's smallest M)
    puts the row tile in the tensor cores' N slot."""
    m, k = x_fp8.shape
    n = qweight.shape[0]
    if k % config.block_k or qweight.shape[1] != k:
        raise ValueError(f"fp8_w8a8_matmul: K={k} (weight {tuple(qweight.shape)}) is not whole "
                         f"{config.block_k}-wide tiles")
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    num_tiles = k // config.block_k
    programs = triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m)
    split, tiles_per_split = split_k(config, num_tiles, programs, x_fp8.device)
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x_fp8.device) if split > 1 else out
    fp8_w8a8_kernel[(programs, 1, split)](
        x_fp8, qweight, x_scale.reshape(-1), w_scale.reshape(-1), partial, out, split_counters(x_fp8.device),
        m, n, num_tiles, tiles_per_split, x_fp8.stride(0), qweight.stride(0), out.stride(0), m * n,
        SPLIT=split > 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SWAP_AB=config.block_m < 64 if swap_ab is None else swap_ab,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# Rows the kernel takes: above them `torch._scaled_mm` (prefill sizes, where cuBLAS's large
# tiles fill the GPU); one row runs on the weight-only kernel with the RMSNorms fused in.
W8A8_MIN_ROWS = 2
W8A8_MAX_ROWS = 128
# From `python benchmarks/gpu_fp8_w8a8_sweep.py` on an H100 (llama3-8b's linears): 64 x 64
# tiles 256 deep, row tiles adjacent in launch order, one wave.
DECODE_CONFIG = LaunchConfig(64, 64, 256, num_warps=4, num_stages=3, waves=1)
# At 2-16 rows one 16-row tile in the tensor cores' N slot (swap_ab): within 3% of each
# linear's fastest of 18 tiles in the same sweep, where a 64-row tile wastes 48-62 rows.
NARROW_CONFIG = LaunchConfig(16, 64, 256, num_warps=4, num_stages=3, waves=1)
# Past 64 rows cuBLAS keeps the wide linears as fast or faster (at 128 rows gate/up 58.6 us
# against 59.4, qkv 21.2 / 21.2); the long-K down (K 14336: 38.8 against 47.0) and o_proj
# (18.0 / 18.7) gain from split K.
_WIDE_OUT_FEATURES = 6144
_LONG_IN_FEATURES = 8192


def decode_config(rows: int) -> LaunchConfig:
    """The tile for `rows` rows of x, where the kernel runs them."""
    return NARROW_CONFIG if rows <= NARROW_CONFIG.block_m else DECODE_CONFIG


def w8a8_config(rows: int, out_features: int, in_features: int) -> LaunchConfig | None:
    """The launch configuration for `rows` rows of x against a [out_features, in_features]
    weight, or None where `torch._scaled_mm` or the weight-only kernel is the faster."""
    if not W8A8_MIN_ROWS <= rows <= W8A8_MAX_ROWS or in_features % DECODE_CONFIG.block_k:
        return None
    if rows > 64 and out_features >= _WIDE_OUT_FEATURES and in_features < _LONG_IN_FEATURES:
        return None
    return decode_config(rows)
