"""4-bit weights (nibble pairs, float offsets in groups) against 2-16 rows of x on the
tensor cores through tl.dot, the weight tile in the MMA's M slot (swap_ab, as fp8_w8a8 does
it): on Hopper that is wgmma with M = 64 weight rows and N = 16 rows of x, the weight tiles
streamed through Triton's multi-stage pipeline. The mma.sync kernel (mma.py) holds one tile
ahead in registers; at 4-8 rows it reads llama3-8b's int4 linears at under half of the
bandwidth (configs.py).

A nibble becomes the bf16 (fp16) value B + q, B = 128 (1024), by OR-ing it into B's bits: no
int-to-float conversion, exact. The tile's products then hold B * sum(x), which comes off with
the offset: y = sum_groups (scale * P + (offset - B * scale) * sum(x)), P the tile's MMA over
(B + q) x, in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.quantization.weight_only.configs import LaunchConfig
from kvserve.quantization.weight_only.tiles import split_tiles, store_block


@triton.jit
def _biased_nibbles(w, X_BF16: tl.constexpr):
    """The low and high nibbles of bytes w as run-dtype tensors of B + q (exact)."""
    bias_bits: tl.constexpr = 0x4300 if X_BF16 else 0x6400
    dtype: tl.constexpr = tl.bfloat16 if X_BF16 else tl.float16
    w = w.to(tl.int16)
    low = ((w & 15) | bias_bits).to(dtype, bitcast=True)
    high = ((w >> 4) | bias_bits).to(dtype, bitcast=True)
    return low, high


@triton.jit
def int4_wgmma_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, partial_ptr, out_ptr, count_ptr,
    M, N, num_tiles, tiles_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_om, stride_ps,
    X_BF16: tl.constexpr, HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (column blocks, 1, splits of K); all M (<= BLOCK_M) rows of x in each program.
    A K tile lies inside one group (BLOCK_K divides group_size). The low nibbles (even k)
    and high nibbles (odd k) are two MMAs against x's even and odd elements."""
    BIAS: tl.constexpr = 128.0 if X_BF16 else 1024.0
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    first, last = split_tiles(num_tiles, tiles_per_split, False)
    half = tl.arange(0, BLOCK_K // 2)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + first * (BLOCK_K // 2) + half[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + first * BLOCK_K + 2 * half[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for tile in range(first, last):
        # Weights are read once per step: keep them from evicting x and the partials.
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0, eviction_policy="evict_first")
        x_even = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        x_odd = tl.load(x_ptrs + 1, mask=row_mask[:, None], other=0.0)
        low, high = _biased_nibbles(w, X_BF16)
        products = tl.dot(low, tl.trans(x_even))
        products = tl.dot(high, tl.trans(x_odd), products)
        x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
        group = tile * BLOCK_K // group_size
        scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_mask, other=0.0).to(tl.float32)
        offset = -BIAS * scale
        if HAS_OFFSET:
            offset += tl.load(offset_ptr + cols * stride_sn + group, mask=col_mask, other=0.0).to(tl.float32)
        acc += products * scale[:, None] + offset[:, None] * x_sum[None, :]
        w_ptrs += BLOCK_K // 2
        x_ptrs += BLOCK_K
    store_block(acc, rows, cols, row_mask, col_mask, partial_ptr, out_ptr, count_ptr, stride_om, stride_ps,
                SPLIT, True)


def int4_wgmma_applies(rows: int, in_features: int, group_size: int, config: LaunchConfig) -> bool:
    """Whether the kernel takes `rows` rows against [N, in_features] 4-bit weights in groups
    of group_size with config's tiles: all rows in one tile, K tiles inside the groups."""
    return (rows <= config.block_m and group_size % config.block_k == 0 and in_features % config.block_k == 0)


def int4_wgmma_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
    config: LaunchConfig,
) -> torch.Tensor:
    """x [M, K] bf16/fp16 (M <= config.block_m, rows contiguous) times nibble pairs qweight
    [N, K / 2] (even k in the low nibble) with scale and offset [N, K / group_size] (fp16 or
    fp32; offset None: symmetric) -> [M, N] in x's dtype. K is split until about
    config.waves programs run per SM; the splits' partials are summed in the kernel."""
    from kvserve.quantization.weight_only.matmul import split_counters, split_k

    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    num_tiles = k // config.block_k
    programs = triton.cdiv(n, config.block_n)
    split, tiles_per_split = split_k(config, num_tiles, programs, x.device)
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    int4_wgmma_kernel[(programs, 1, split)](
        x, qweight, scale, offset if offset is not None else scale, partial, out, split_counters(x.device),
        m, n, num_tiles, tiles_per_split, group_size,
        x.stride(0), qweight.stride(0), scale.stride(0), out.stride(0), m * n,
        X_BF16=x.dtype == torch.bfloat16, HAS_OFFSET=offset is not None, SPLIT=split > 1,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
