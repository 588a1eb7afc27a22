"""A mixture of experts' MLPs for a few tokens: one GEMV program per (token, choice) pair and
column block, reading the chosen expert's weights straight from the routing, with no sort.

With a handful of pairs (decode at small batch sizes) the grouped GEMMs of ops/fused_moe.py
spend most of each 16-row tensor-core tile on padding and, for packed weights, their
dequantizing tl.dot tiles run far below the memory bandwidth; a GEMV on the CUDA cores reads
each chosen expert's bytes once at close to it. Three launches a layer: gate/up with SwiGLU
in its epilogue (the [pairs, 2I] intermediate is never written), down into fp32 split-K
partials, and one combine that sums each token's pairs, scaled by their routing weights,
over the splits in a fixed order (deterministic: no atomics). The RMSNorms around the layer
can run inside it (PendingNorm): gate/up scales its products by the norm before it, the
combine (or the summed down GEMV) adds the output to the residual stream and leaves the
norm after it pending (experts_gemv_add_norm).

Weights as ExpertWeights holds them: dense [E, N, K], or int8 / float8_e4m3fn [E, N, K] or
4-bit nibble pairs [E, N, K / 2] with scales (and offsets) [E, N, K / group_size].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve.ops import device as device_info
from kvserve.ops import pdl
from kvserve.ops.expert_weights import ExpertWeights
from kvserve.ops.pending_norm import PendingNorm
from kvserve.ops.pending_norm_tiles import add_norm_store, load_norm_sums, row_scale_of


class GemvTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


def uses_gemv(num_pairs: int, num_experts: int, top_k: int, packed: bool) -> bool:
    """Whether a launch of `num_pairs` (token, choice) pairs takes the GEMVs. Each pair reads
    its expert whole, so once tokens share experts the grouped GEMMs, which read each chosen
    expert once, win: one token always takes the GEMVs; dense experts while the pairs are at
    most a quarter of the experts (two tokens rarely share one of 128); packed experts,
    whose grouped GEMM dequantizes on tensor-core tiles far below the bandwidth, up to one
    pair an expert (H200: Mixtral int4 at 4 tokens 0.70 ms against 1.38)."""
    return num_pairs <= max(top_k, num_experts if packed else num_experts // 4)


def default_tile(weights: ExpertWeights) -> GemvTile:
    """From the H200 sweeps (benchmarks/gpu_moe_gemv_sweep.py, gpu_moe_decode_kernels.py):
    narrow blocks of long k runs for 4-bit rows (8 x 512: 256 bytes a row a tile); 8-row
    blocks for the rest, 512 wide along a long k (Mixtral's 4096 and 14336: gate/up 119 ->
    112 us, down 65 -> 59 us), 256 along a short one (Qwen3-30B-A3B's 2048 and 768)."""
    if weights.four_bit:
        return GemvTile(8, 512, 4)
    return GemvTile(8, 512 if weights.in_features >= 4096 else 256, 4)


@triton.jit
def _dequantized_tile(q, scale_ptrs, offset_ptrs, scale_mask, QUANT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                      GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, STORED_K: tl.constexpr):
    """[BLOCK_N, STORED_K] stored values as fp32 weights; the tile spans GROUPS groups along k,
    their scales (and offsets) [BLOCK_N, GROUPS] at scale_ptrs / offset_ptrs."""
    w = q.to(tl.float32)
    if QUANT:
        scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0).to(tl.float32)
        w = tl.reshape(w, (BLOCK_N, GROUPS, STORED_K // GROUPS)) * scale[:, :, None]
        if HAS_OFFSET:
            offset = tl.load(offset_ptrs, mask=scale_mask, other=0.0).to(tl.float32)
            w += offset[:, :, None]
        w = tl.reshape(w, (BLOCK_N, STORED_K))
    return w


@triton.jit
def _row_dot(acc, w_ptrs, x_ptrs, scale_ptrs, offset_ptrs, w_mask, x_mask, scale_mask,
             QUANT: tl.constexpr, FOUR_BIT: tl.constexpr, HAS_OFFSET: tl.constexpr, GROUPS: tl.constexpr,
             BLOCK_N: tl.constexpr, STORED_K: tl.constexpr):
    """acc [BLOCK_N, STORED_K] += one k tile of the weight rows times x's (lane-wise; the sum
    over k is taken once, at the end)."""
    # No `other` (a float8 fill cannot be given): masked lanes are zeroed below.
    q = tl.load(w_ptrs, mask=w_mask, eviction_policy="evict_first")
    if FOUR_BIT:
        x_even = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptrs + 1, mask=x_mask, other=0.0).to(tl.float32)
        low = _dequantized_tile(q & 15, scale_ptrs, offset_ptrs, scale_mask, QUANT, HAS_OFFSET, GROUPS, BLOCK_N,
                                STORED_K)
        high = _dequantized_tile(q >> 4, scale_ptrs, offset_ptrs, scale_mask, QUANT, HAS_OFFSET, GROUPS, BLOCK_N,
                                 STORED_K)
        acc += tl.where(w_mask, low * x_even[None, :] + high * x_odd[None, :], 0.0)
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        w = _dequantized_tile(q, scale_ptrs, offset_ptrs, scale_mask, QUANT, HAS_OFFSET, GROUPS, BLOCK_N, STORED_K)
        acc += tl.where(w_mask, w * x[None, :], 0.0)
    return acc


@triton.jit
def _pair_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr, chosen_ptr, pending_ptr,
    N, K, k_per_split, second_rows, pending_partials, norm_eps,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_os, stride_om,
    ROWS_PER_X: tl.constexpr, SWIGLU: tl.constexpr, QUANT: tl.constexpr, FOUR_BIT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, ROW_SCALE: tl.constexpr, PARTIALS: tl.constexpr,
):
    """For pair p (x row p // ROWS_PER_X, expert chosen[p]) and one BLOCK_N block of the
    output columns, over split s's k range: SWIGLU: out[p, n] = silu(W[n] x) * (W[n +
    second_rows] x) in out's dtype (one split); else fp32 partials out[s, p, n] = W[n] x.
    Chained (kvserve.ops.pdl): which expert to read is the previous kernel's output.
    ROW_SCALE: x is a PendingNorm's rows; both products are scaled by its row's norm factor
    (norm_row_scale) before the SwiGLU."""
    pdl.chained(PDL)
    pair = tl.program_id(0)
    split = tl.program_id(2)
    expert = tl.load(chosen_ptr + pair)
    row = pair // ROWS_PER_X
    if ROW_SCALE:
        # Loaded here, summed after the loop: the loads overlap the loop instead of stalling it.
        this_row = row + tl.zeros([1], dtype=tl.int32)
        norm_sums = load_norm_sums(pending_ptr, this_row, this_row >= 0, pending_partials, PARTIALS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    STORED_K: tl.constexpr = BLOCK_K // 2 if FOUR_BIT else BLOCK_K
    STEP: tl.constexpr = 2 if FOUR_BIT else 1
    GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE if BLOCK_K > GROUP_SIZE else 1
    offs = tl.arange(0, STORED_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_rows = w_base + cols[:, None].to(tl.int64) * stride_wn
    s_rows = scale_ptr + expert * stride_se + cols[:, None] * stride_sn
    o_rows = offset_ptr + expert * stride_se + cols[:, None] * stride_sn
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N, STORED_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, STORED_K), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = STEP * offs < k_end - k0
        w_mask = col_mask[:, None] & k_mask[None, :]
        groups = k0 // GROUP_SIZE + tl.arange(0, GROUPS)
        scale_mask = col_mask[:, None] & (groups * GROUP_SIZE < k_end)[None, :]
        x_ptrs = x_row + k0 + STEP * offs
        w_ptrs = w_rows + k0 // STEP + offs[None, :]
        acc = _row_dot(acc, w_ptrs, x_ptrs, s_rows + groups[None, :], o_rows + groups[None, :], w_mask, k_mask,
                       scale_mask, QUANT, FOUR_BIT, HAS_OFFSET, GROUPS, BLOCK_N, STORED_K)
        if SWIGLU:
            acc2 = _row_dot(acc2, w_ptrs + second_rows * stride_wn, x_ptrs,
                            s_rows + second_rows * stride_sn + groups[None, :],
                            o_rows + second_rows * stride_sn + groups[None, :], w_mask, k_mask, scale_mask,
                            QUANT, FOUR_BIT, HAS_OFFSET, GROUPS, BLOCK_N, STORED_K)
    y = tl.sum(acc, axis=1)
    if ROW_SCALE:
        row_scale = tl.sum(row_scale_of(norm_sums, K, norm_eps))
        y *= row_scale
    if SWIGLU:
        up = tl.sum(acc2, axis=1)
        if ROW_SCALE:
            up *= row_scale
        y = y / (1.0 + tl.exp(-y)) * up
        tl.store(out_ptr + pair * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(out_ptr + split * stride_os + pair * stride_om + cols, y, mask=col_mask)


@triton.jit
def _summed_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, out_ptr, chosen_ptr, weights_ptr, residual_ptr, norm_weight_ptr,
    sum_squares_ptr, N, K, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    TOP_K: tl.constexpr, QUANT: tl.constexpr, FOUR_BIT: tl.constexpr, HAS_OFFSET: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ADD_NORM: tl.constexpr,
):
    """For token t (grid axis 1) and one BLOCK_N block of the output columns (axis 0):
    out[t, n] = sum over t's choices c of weights[t, c] x W[chosen[t, c]][n] . x[t top_k +
    c], in choice order, in out's dtype (the down GEMV with the combine in its epilogue: no
    partials, no third launch). ADD_NORM: the residual add and the RMSNorm after the layer
    left pending (add_norm_store)."""
    pdl.chained(PDL)
    token = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    STORED_K: tl.constexpr = BLOCK_K // 2 if FOUR_BIT else BLOCK_K
    STEP: tl.constexpr = 2 if FOUR_BIT else 1
    GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE if BLOCK_K > GROUP_SIZE else 1
    offs = tl.arange(0, STORED_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        pair = token * TOP_K + choice
        expert = tl.load(chosen_ptr + pair)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        s_rows = scale_ptr + expert * stride_se + cols[:, None] * stride_sn
        o_rows = offset_ptr + expert * stride_se + cols[:, None] * stride_sn
        x_row = x_ptr + pair * stride_xm
        acc = tl.zeros((BLOCK_N, STORED_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = STEP * offs < K - k0
            groups = k0 // GROUP_SIZE + tl.arange(0, GROUPS)
            acc = _row_dot(acc, w_rows + k0 // STEP + offs[None, :], x_row + k0 + STEP * offs,
                           s_rows + groups[None, :], o_rows + groups[None, :], col_mask[:, None] & k_mask[None, :],
                           k_mask, col_mask[:, None] & (groups * GROUP_SIZE < K)[None, :],
                           QUANT, FOUR_BIT, HAS_OFFSET, GROUPS, BLOCK_N, STORED_K)
        total += tl.load(weights_ptr + pair) * tl.sum(acc, axis=1)
    _store_token_row(total, token, cols, col_mask, out_ptr, stride_om, residual_ptr, norm_weight_ptr, sum_squares_ptr,
                     ADD_NORM)


@triton.jit
def _store_token_row(total, token, cols, col_mask, out_ptr, stride_om, residual_ptr, norm_weight_ptr,
                     sum_squares_ptr, ADD_NORM: tl.constexpr):
    """A token's block of the layer's output into out, or (ADD_NORM) added to the residual
    stream with the RMSNorm after it left pending (add_norm_store: out = h * the norm's
    weight, the block's sum of h^2 at sum_squares[token, column block])."""
    if ADD_NORM:
        token_row = token + tl.zeros([1], dtype=tl.int32)
        add_norm_store(total[None, :], token_row, cols, token_row >= 0, col_mask, out_ptr, stride_om, residual_ptr,
                       norm_weight_ptr, sum_squares_ptr)
    else:
        tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _combine_kernel(partials_ptr, weights_ptr, out_ptr, residual_ptr, norm_weight_ptr, sum_squares_ptr, N,
                    num_splits, stride_ps, stride_pm, stride_om,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, ADD_NORM: tl.constexpr):
    """out[t, n] = sum over t's choices c of weights[t, c] x sum over splits of partials[s, t
    top_k + c, n], in this fixed order; token t on grid axis 1, column blocks on axis 0.
    ADD_NORM: _store_token_row's."""
    pdl.chained(PDL)
    token = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        pair = token * TOP_K + choice
        summed = tl.zeros((BLOCK,), dtype=tl.float32)
        for split in range(num_splits):
            summed += tl.load(partials_ptr + split * stride_ps + pair * stride_pm + cols, mask=mask, other=0.0)
        total += tl.load(weights_ptr + pair) * summed
    _store_token_row(total, token, cols, mask, out_ptr, stride_om, residual_ptr, norm_weight_ptr, sum_squares_ptr,
                     ADD_NORM)


def _group_size(w: ExpertWeights, block_k: int) -> int:
    """The GROUP_SIZE the kernels take: the weights' scale groups, or for one group a row (and
    dense weights) at least a tile, so that every tile's group is 0."""
    if w.scale is not None and w.group_size < w.in_features:
        assert block_k % w.group_size == 0 or w.group_size % block_k == 0, (block_k, w.group_size)
        return w.group_size
    return max(w.in_features, block_k)


def _launch(x: torch.Tensor, w: ExpertWeights, out: torch.Tensor, chosen: torch.Tensor, n: int,
            rows_per_x: int, swiglu: bool, num_splits: int, k_per_split: int, tile: GemvTile,
            pending: PendingNorm | None = None) -> None:
    """`pending`: x is its rows, the norm finished in the kernel."""
    quantized = w.scale is not None
    scales = w.scale if quantized else w.weight
    block_k = tile.block_k
    group_size = _group_size(w, block_k)
    num_pairs = chosen.numel()
    grid = (num_pairs, triton.cdiv(n, tile.block_n), num_splits)
    partials = pending.sums.shape[-1] if pending is not None else 1
    _pair_gemv_kernel[grid](
        x, w.weight, scales, w.offset if w.offset is not None else scales, out, chosen,
        pending.sums if pending is not None else out, n, w.in_features, k_per_split, n if swiglu else 0,
        partials, pending.eps if pending is not None else 0.0,
        x.stride(0), w.weight.stride(0), w.weight.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0) if not swiglu else 0, out.stride(-2),
        ROWS_PER_X=rows_per_x, SWIGLU=swiglu, QUANT=quantized, FOUR_BIT=w.four_bit,
        HAS_OFFSET=w.offset is not None, GROUP_SIZE=group_size, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        ROW_SCALE=pending is not None, PARTIALS=triton.next_power_of_2(partials), num_warps=tile.num_warps,
        **pdl.chained_options(x.device),
    )


def down_splits(num_pairs: int, hidden: int, intermediate: int, tile: GemvTile, device: torch.device) -> int:
    """Split the down GEMV's k so that about 4 programs a multiprocessor run: few pairs over
    a narrow hidden size leave most of the GPU idle otherwise. Each split a whole number of
    k tiles."""
    programs = num_pairs * triton.cdiv(hidden, tile.block_n)
    tiles = triton.cdiv(intermediate, tile.block_k)
    return max(1, min(tiles, triton.cdiv(4 * device_info.num_sms(device), programs)))


class AddNorm(NamedTuple):
    """The residual add and RMSNorm after the layer, in its last kernel's epilogue: residual
    [T, H] (contiguous, updated in place to residual + the layer's output), the norm's weight
    [H], and sums [T, column blocks] fp32 for the blocks' sums of h^2 (PendingNorm.sums)."""
    residual: torch.Tensor
    weight: torch.Tensor
    sums: torch.Tensor


def _launch_summed(activation: torch.Tensor, w: ExpertWeights, out: torch.Tensor, chosen: torch.Tensor,
                   weights: torch.Tensor, tile: GemvTile, add_norm: AddNorm | None) -> None:
    tokens, top_k = weights.shape
    n = w.weight.shape[1]
    quantized = w.scale is not None
    scales = w.scale if quantized else w.weight
    group_size = _group_size(w, tile.block_k)
    _summed_gemv_kernel[(triton.cdiv(n, tile.block_n), tokens)](
        activation, w.weight, scales, w.offset if w.offset is not None else scales, out, chosen,
        weights.reshape(-1).float().contiguous(), *(add_norm or (out, out, out)), n, w.in_features,
        activation.stride(0), w.weight.stride(0), w.weight.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), TOP_K=top_k, QUANT=quantized, FOUR_BIT=w.four_bit, HAS_OFFSET=w.offset is not None,
        GROUP_SIZE=group_size, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ADD_NORM=add_norm is not None,
        num_warps=tile.num_warps, **pdl.chained_options(out.device),
    )


def summed_by_default(top_k: int, splits: int) -> bool:
    """Whether the down GEMV sums each token's choices itself (no partials, no combine
    launch): where it needs no split of k and a token has at most two choices. Each program
    runs its choices one after another: two long k runs stream (H200, Mixtral, one token:
    down and combine 65 -> 59 us), while Qwen3-30B-A3B's eight short ones (768 wide) leave
    its loads waiting (9 + 2 -> 14 us)."""
    return splits == 1 and top_k <= 2


def experts_gemv(x: torch.Tensor | PendingNorm, chosen: torch.Tensor, weights: torch.Tensor, w13: ExpertWeights,
                 w2: ExpertWeights, gate_up_tile: GemvTile | None = None,
                 down_tile: GemvTile | None = None, num_splits: int | None = None,
                 summed_down: bool | None = None) -> torch.Tensor:
    """fused_experts' result for a few tokens by the pair GEMVs: x [T, H]; chosen [T, top_k];
    weights [T, top_k]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. `num_splits`
    of the down GEMV's k (default: down_splits'); `summed_down`: the down GEMV sums each
    token's choices itself (_summed_gemv_kernel; default: when it needs no split). x a
    PendingNorm: its rows, the norm finished by the gate/up GEMV (its products scaled)."""
    out, _ = _experts_gemv(x, chosen, weights, w13, w2, gate_up_tile, down_tile, num_splits, summed_down)
    return out


def experts_gemv_add_norm(x: torch.Tensor | PendingNorm, chosen: torch.Tensor, weights: torch.Tensor,
                          w13: ExpertWeights, w2: ExpertWeights, residual: torch.Tensor, norm_weight: torch.Tensor,
                          gate_up_tile: GemvTile | None = None, down_tile: GemvTile | None = None,
                          num_splits: int | None = None, summed_down: bool | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """experts_gemv followed by the residual add and RMSNorm after the layer, in its last
    kernel's epilogue (the combine, or the summed down GEMV): residual [T, H] (contiguous, in
    x's dtype) updated in place to h = residual + the layer's output; returns (h x
    norm_weight, the column blocks' sums of h^2 [T, blocks] fp32), a PendingNorm's rows and
    sums."""
    return _experts_gemv(x, chosen, weights, w13, w2, gate_up_tile, down_tile, num_splits, summed_down,
                         (residual, norm_weight))


def _experts_gemv(x: torch.Tensor | PendingNorm, chosen: torch.Tensor, weights: torch.Tensor, w13: ExpertWeights,
                  w2: ExpertWeights, gate_up_tile: GemvTile | None, down_tile: GemvTile | None,
                  num_splits: int | None, summed_down: bool | None,
                  add_norm_of: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(experts_gemv's output, None), or with add_norm_of (residual, norm weight)
    experts_gemv_add_norm's (rows, sums)."""
    pending = x if isinstance(x, PendingNorm) else None
    x = x.rows if pending is not None else x
    tokens, top_k = chosen.shape
    intermediate = w13.weight.shape[1] // 2
    hidden = w13.in_features
    gate_up_tile = gate_up_tile or default_tile(w13)
    down_tile = down_tile or default_tile(w2)
    flat_chosen = chosen.reshape(-1)
    num_pairs = flat_chosen.numel()
    activation = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    _launch(x, w13, activation, flat_chosen, intermediate, top_k, True, 1, hidden, gate_up_tile, pending)
    splits = num_splits or down_splits(num_pairs, hidden, intermediate, down_tile, x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    summed = summed_down if summed_down is not None else summed_by_default(top_k, splits)
    block = down_tile.block_n if summed else 512  # the last kernel's column block
    add_norm = None
    if add_norm_of is not None:
        sums = torch.empty(tokens, triton.cdiv(hidden, block), dtype=torch.float32, device=x.device)
        add_norm = AddNorm(*add_norm_of, sums)
    if summed:
        _launch_summed(activation, w2, out, flat_chosen, weights, down_tile, add_norm)
        return out, None if add_norm is None else add_norm.sums
    k_per_split = triton.cdiv(triton.cdiv(intermediate, down_tile.block_k), splits) * down_tile.block_k
    splits = triton.cdiv(intermediate, k_per_split)
    partials = torch.empty(splits, num_pairs, hidden, dtype=torch.float32, device=x.device)
    _launch(activation, w2, partials, flat_chosen, hidden, 1, False, splits, k_per_split, down_tile)
    _combine_kernel[(triton.cdiv(hidden, block), tokens)](
        partials, weights.reshape(-1).float().contiguous(), out, *(add_norm or (out, out, out)), hidden, splits,
        partials.stride(0), partials.stride(1), out.stride(0), TOP_K=top_k, BLOCK=block,
        ADD_NORM=add_norm is not None, **pdl.chained_options(x.device),
    )
    return out, None if add_norm is None else add_norm.sums
