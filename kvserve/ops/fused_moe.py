"""A mixture of experts' MLPs on the GPU in two grouped GEMMs, with no host synchronisation
(so a decode step with it is CUDA-graph capturable).

The (token, choice) pairs are sorted by expert and each expert's run padded to BLOCK_M
(`align_by_expert`, vLLM's moe_align_block_size idea done with torch ops on the device):
every BLOCK_M-row tile of the sorted list belongs to one expert, so one program multiplies
the tile's rows, gathered from the activations, by that expert's weights. A step reads only
the experts some token chose; padding rows and the tiles past the end exit early. The
gate/up GEMM writes [pairs, 2 x intermediate], SwiGLU makes [pairs, intermediate], and the
down GEMM scales each row by its routing weight in the epilogue before the pairs of a token
are summed. A few tokens take the pair GEMVs of ops/fused_moe_gemv.py instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.elementwise import silu_and_mul
from kvserve.ops.expert_weights import ExpertWeights, weight_format
from kvserve.ops.fused_moe_configs import GemmTile, MoEConfig, config_for
from kvserve.ops.fused_moe_gemv import experts_gemv, uses_gemv


def align_by_expert(chosen: torch.Tensor, num_experts: int, block: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chosen [T, top_k] expert ids -> (sorted_pairs, block_experts, num_padded): the flat
    indices (token x top_k + choice) grouped by expert, each group padded with the sentinel
    T x top_k to a multiple of `block`, in a buffer of the largest size any routing needs
    (T x top_k + E x (block - 1)); the expert of each block (num_experts past the end); and
    the padded length (a 1-element tensor). Shapes depend on T alone: no host reads. One
    kernel launch (a decode step runs this once per layer, so launches are what it costs).
    Within an expert's run the pairs come in no fixed order: each row of a GEMM tile is
    computed on its own, so the results do not depend on it."""
    chosen = chosen.contiguous()
    pairs = chosen.numel()
    capacity = pairs + num_experts * (block - 1)
    device = chosen.device
    sorted_pairs = torch.empty(capacity, dtype=torch.int64, device=device)
    block_experts = torch.empty(capacity // block, dtype=torch.int64, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    scratch = torch.empty(2 * experts_pow2, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        chosen, scratch, sorted_pairs, block_experts, num_padded, pairs, capacity, num_experts,
        BLOCK=block, EXPERTS=experts_pow2, CHUNK=1024, BLOCK_CHUNK=max(1, 8192 // experts_pow2),
    )
    return sorted_pairs, block_experts, num_padded


@triton.jit(do_not_specialize=["num_pairs", "capacity"])
def _align_kernel(chosen_ptr, scratch_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
                  num_pairs, capacity, num_experts, BLOCK: tl.constexpr, EXPERTS: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    """One program: count each expert's pairs (integer atomics: exact in any order), lay the
    padded runs end to end, then give each pair a slot in its expert's run by an atomic
    cursor. scratch holds the counts, then the cursors; barriers order the phases."""
    experts = tl.arange(0, EXPERTS)
    real_expert = experts < num_experts
    tl.store(scratch_ptr + experts, tl.zeros([EXPERTS], dtype=tl.int32))
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.zeros([CHUNK], dtype=tl.int64) + num_pairs, mask=offs < capacity)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert = tl.load(chosen_ptr + offs, mask=offs < num_pairs, other=0)
        tl.atomic_add(scratch_ptr + expert, 1, mask=offs < num_pairs)
    tl.debug_barrier()
    counts = tl.load(scratch_ptr + experts)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    ends = tl.cumsum(padded, 0)
    tl.store(scratch_ptr + EXPERTS + experts, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, 0).to(tl.int64))
    # A block's expert: how many real experts' runs end at or before the block starts.
    num_blocks = capacity // BLOCK
    for start in range(0, num_blocks, BLOCK_CHUNK):
        blocks = start + tl.arange(0, BLOCK_CHUNK)
        ended = (ends[None, :] <= blocks[:, None] * BLOCK) & real_expert[None, :]
        tl.store(block_experts_ptr + blocks, tl.sum(ended.to(tl.int64), 1), mask=blocks < num_blocks)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert = tl.load(chosen_ptr + offs, mask=offs < num_pairs, other=0)
        slot = tl.atomic_add(scratch_ptr + EXPERTS + expert, 1, mask=offs < num_pairs)
        tl.store(sorted_pairs_ptr + slot, offs.to(tl.int64), mask=offs < num_pairs)


@triton.jit
def _dequantized(q, scale_ptrs, offset_ptrs, col_mask, QUANT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                 dtype: tl.constexpr):
    """A [k, BLOCK_N] tile of stored values as `dtype` weights: q x scale (+ offset), the scale
    and offset of the tile's one group per column."""
    w = q
    if QUANT:
        scaled = q.to(tl.float32) * tl.load(scale_ptrs, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            scaled += tl.load(offset_ptrs, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w = scaled.to(dtype)
    return w


# num_pairs changes with the batch; specialising on it would compile once per divisibility.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, offset_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_padded_ptr, num_pairs, N, K, stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm,
    ROWS_PER_A: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
    FOUR_BIT: tl.constexpr, HAS_OFFSET: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[pair, :] = a[pair // ROWS_PER_A, :] @ b[expert]^T (x weights[pair] with SCALE) for
    the pairs of one BLOCK_M tile of the sorted list and one BLOCK_N slice of c's columns.
    QUANT: b holds stored values, dequantized tile by tile (BLOCK_K within one group);
    FOUR_BIT: nibble pairs, multiplied as the even and the odd k of a's tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // ROWS_PER_A, 0)
    expert = tl.load(block_experts_ptr + pid_m)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dtype = a_ptr.dtype.element_ty
    # Stored k per tile: nibble pairs hold two k a byte.
    STORED_K: tl.constexpr = BLOCK_K // 2 if FOUR_BIT else BLOCK_K
    STEP: tl.constexpr = 2 if FOUR_BIT else 1
    offs_k = tl.arange(0, STORED_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + STEP * offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + offs_k[:, None]
    scale_ptrs = scale_ptr + expert * stride_se + cols * stride_sn
    offset_ptrs = offset_ptr + expert * stride_se + cols * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        k_mask = STEP * offs_k < k_left
        group = k * BLOCK_K // GROUP_SIZE
        b_mask = k_mask[:, None] & col_mask[None, :]
        # No `other`: a float8 fill cannot be given; masked weights are zeroed once dequantized.
        q = tl.load(b_ptrs, mask=b_mask)
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if FOUR_BIT:
            low = _dequantized(q & 15, scale_ptrs + group, offset_ptrs + group, col_mask, QUANT, HAS_OFFSET, dtype)
            high = _dequantized(q >> 4, scale_ptrs + group, offset_ptrs + group, col_mask, QUANT, HAS_OFFSET, dtype)
            acc = tl.dot(a, tl.where(b_mask, low, 0.0), acc, input_precision=PRECISION)
            a_odd = tl.load(a_ptrs + 1, mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a_odd, tl.where(b_mask, high, 0.0), acc, input_precision=PRECISION)
        else:
            b = _dequantized(q, scale_ptrs + group, offset_ptrs + group, col_mask, QUANT, HAS_OFFSET, dtype)
            acc = tl.dot(a, tl.where(b_mask, b, 0.0), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += STORED_K
    if SCALE:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def grouped_gemm(a: torch.Tensor, b: ExpertWeights, out: torch.Tensor, weights: torch.Tensor,
                 sorted_pairs: torch.Tensor, block_experts: torch.Tensor, num_padded: torch.Tensor,
                 rows_per_a: int, scale: bool, block_m: int, tile: GemmTile) -> None:
    """out[pair] = a[pair // rows_per_a] @ b[expert of pair]^T (x weights[pair] if scale), over
    the pairs `align_by_expert(..., block_m)` sorted."""
    num_pairs, n = out.shape
    k = b.in_features
    stored = b.weight
    assert a.stride(1) == 1 and stored.stride(2) == 1 and out.stride(1) == 1
    block_k = tile.block_k
    quantized = b.scale is not None
    if quantized:
        assert b.scale.is_contiguous() and (b.offset is None or b.offset.stride() == b.scale.stride())
        # A tile's k within one group (a whole row for per-channel scales); 32 at least, so
        # nibble pairs give tl.dot 16.
        if b.group_size < k:
            block_k = min(block_k, b.group_size)
            assert b.group_size % block_k == 0 and block_k >= 32, (b.group_size, block_k)
    grid = (sorted_pairs.shape[0] // block_m, triton.cdiv(n, tile.block_n))
    scales = b.scale if quantized else stored
    _grouped_gemm_kernel[grid](
        a, stored, scales, b.offset if b.offset is not None else scales, out, weights, sorted_pairs,
        block_experts, num_padded, num_pairs, n, k, a.stride(0), stored.stride(0), stored.stride(1),
        scales.stride(0), scales.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, SCALE=scale,
        # fp32 models get fp32 products (tl.dot would round them to tf32).
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        QUANT=quantized, FOUR_BIT=b.four_bit, HAS_OFFSET=b.offset is not None,
        GROUP_SIZE=b.group_size if quantized else k,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def fused_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                  w13: ExpertWeights, w2: ExpertWeights, config: MoEConfig | None = None) -> torch.Tensor:
    """sum over each token's top_k choices of weights x down(silu(gate(x)) * up(x)) of the
    chosen expert. x [T, H]; chosen [T, top_k] expert ids; weights [T, top_k] (fp32);
    w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. Returns [T, H] in x's dtype.
    `config` (the tiles) defaults to the tuned one for this device, shape and weight format.
    A few tokens' pairs take the pair GEMVs instead (ops/fused_moe_gemv.py)."""
    tokens, top_k = chosen.shape
    num_experts, two_i = w13.weight.shape[:2]
    if config is None and uses_gemv(tokens * top_k, num_experts, top_k, w13.scale is not None):
        return experts_gemv(x, chosen, weights, w13, w2)
    hidden = w13.in_features
    if config is None:
        config = config_for(tokens, num_experts, hidden, two_i // 2, weight_format(w13, x.dtype), x.device)
    sorted_pairs, block_experts, num_padded = align_by_expert(chosen, num_experts, config.block_m)
    flat_weights = weights.flatten().float().contiguous()
    gate_up = torch.empty(tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, flat_weights, sorted_pairs, block_experts, num_padded, top_k, False,
                 config.block_m, config.gate_up)
    activation = silu_and_mul(gate_up)
    down = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(activation, w2, down, flat_weights, sorted_pairs, block_experts, num_padded, 1, True,
                 config.block_m, config.down)
    return down.view(tokens, top_k, hidden).sum(dim=1)
