"""A mixture of experts' routing in one launch: router logits [T, E] -> each token's top_k
expert ids and routing weights, as SparseMoE defines them (a softmax over all E experts in
fp32, the top_k kept, and with `renormalize` scaled to sum to one), where torch takes a
cast, a softmax, a top-k (a gather and a sort), a sum and a division: six launches a layer,
which at batch 1 cost more than the arithmetic. Qwen2-MoE's shared-expert gate, sigmoid(its
logit), rides along. `route_hidden` computes the router's logits in the same launch too,
for the few tokens of a decode step.

One program per token holds the token's E logits (E up to a few hundred) in registers and
picks the top_k by repeated arg-max. The choice is made on the logits, which the softmax
orders the same way, so it does not depend on how exp rounds: exactly equal logits go to the
lower expert index, and the choices come out by weight descending, ties by index ascending
(torch.topk on CUDA gathers the same set, tests/ops/test_moe_routing.py checks; it leaves
the order among equal weights unspecified). No host reads: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops import pdl
from kvserve.ops.pending_norm import PendingNorm
from kvserve.ops.pending_norm_tiles import norm_row_scale
from kvserve.ops.split_k import split_counters


@triton.jit
def _pick(x, real, token, ids_ptr, weights_ptr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids[token] (int32) and weights[token] (fp32) of the top TOP_K of one token's fp32
    logits x [BLOCK_E] (real: the lanes that are experts)."""
    experts = tl.arange(0, BLOCK_E)
    top = tl.max(x, 0)
    e = tl.where(real, tl.exp(x - top), 0.0)
    total = tl.sum(e, 0)
    # Taken and padding lanes at -inf; -inf logits raised to the lowest finite value so that
    # they stay below every real one but above those.
    candidates = tl.where(real, tl.maximum(x, -3.4028234663852886e38), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best, index = tl.max(candidates, 0, return_indices=True, return_indices_tie_break_left=True)
        # exp(-inf or lowest - top) is 0 as the softmax's own exp(-inf - top).
        prob = tl.exp(tl.where(best > -3.4028234663852886e38, best, float("-inf")) - top) / total
        ids = tl.where(slots == slot, index, ids)
        weights = tl.where(slots == slot, prob, weights)
        candidates = tl.where(experts == index, float("-inf"), candidates)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    out = token * TOP_K + slots
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)


@triton.jit
def _routing_kernel(logits_ptr, ids_ptr, weights_ptr, shared_logits_ptr, shared_gate_ptr, num_experts,
                    stride_t, stride_shared, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """_pick on token t's logits; HAS_SHARED: shared_gate[t] = sigmoid(shared_logits[t]) in
    their dtype."""
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    x = tl.load(logits_ptr + token * stride_t + experts, mask=real, other=float("-inf")).to(tl.float32)
    _pick(x, real, token, ids_ptr, weights_ptr, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    if HAS_SHARED:
        g = tl.load(shared_logits_ptr + token * stride_shared).to(tl.float32)
        tl.store(shared_gate_ptr + token, (1.0 / (1.0 + tl.exp(-g))).to(shared_gate_ptr.dtype.element_ty))


@triton.jit
def _gate_rows(acc, x_row, w_rows, row_mask, start, hidden, BLOCK_H: tl.constexpr):
    """acc [ROWS, BLOCK_H] += the weight rows at w_rows times x lane-wise, over hidden from
    `start` on."""
    for h0 in range(start, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_mask = cols < hidden
        x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return acc


@triton.jit
def _gate_and_route_kernel(x_ptr, w_ptr, shared_w_ptr, logits_ptr, count_ptr, ids_ptr, weights_ptr,
                           shared_gate_ptr, pending_ptr, num_experts, hidden, stride_x, stride_w,
                           pending_partials, norm_eps,
                           TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr, ROW_SCALE: tl.constexpr,
                           PARTIALS: tl.constexpr):
    """Program (t, p): the router logits of experts p x ROWS.. for token t, x[t] . w[e] summed
    in fp32 and rounded to x's dtype (the router linear's output), left in logits[t]; the
    last of token t's programs to arrive (an acq_rel counter, re-armed to 0) picks from the
    row (_pick). HAS_SHARED: program (t, 0) also leaves sigmoid(x[t] . shared_w) in
    shared_gate[t], the logit rounded to x's dtype first. With PDL the first weight tile
    (which nothing in the step writes) loads before the wait for the previous kernel.
    ROW_SCALE: x is a PendingNorm's rows; the sums finish its norm (norm_row_scale), scaling
    the logits before they are rounded."""
    if PDL:  # the next kernel may launch (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    part = tl.program_id(1)
    x_row = x_ptr + token * stride_x
    rows = part * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_experts
    w_rows = w_ptr + rows.to(tl.int64) * stride_w
    first = tl.arange(0, BLOCK_H)
    first_mask = first < hidden
    w = tl.load(w_rows[:, None] + first[None, :], mask=row_mask[:, None] & first_mask[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x (and a pending norm's sums) are the previous kernels' output
    x = tl.load(x_row + first, mask=first_mask, other=0.0).to(tl.float32)
    acc = _gate_rows(w.to(tl.float32) * x[None, :], x_row, w_rows, row_mask, BLOCK_H, hidden, BLOCK_H)
    row_scale = 1.0
    if ROW_SCALE:  # read after the logits' sums: read before them, it spilled at one warp a program
        token_row = token + tl.zeros([1], dtype=tl.int32)
        row_scale = tl.sum(norm_row_scale(pending_ptr, token_row, token_row >= 0, pending_partials, hidden, norm_eps,
                                          PARTIALS))
    dtype = x_ptr.dtype.element_ty
    tl.store(logits_ptr + token * num_experts + rows, (tl.sum(acc, 1) * row_scale).to(dtype), mask=row_mask)
    if HAS_SHARED:
        if part == 0:
            one = tl.arange(0, ROWS) < 1  # one weight row, in a tile of the gate's shape
            shared = _gate_rows(tl.zeros([ROWS, BLOCK_H], dtype=tl.float32), x_row,
                                shared_w_ptr + tl.zeros([ROWS], dtype=tl.int64), one, 0, hidden, BLOCK_H)
            g = (tl.sum(tl.sum(shared, 1), 0) * row_scale).to(dtype).to(tl.float32)
            tl.store(shared_gate_ptr + token, (1.0 / (1.0 + tl.exp(-g))).to(dtype))
    tl.debug_barrier()  # every thread's logits are written before one thread releases them
    if tl.atomic_add(count_ptr + token, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        experts = tl.arange(0, BLOCK_E)
        real = experts < num_experts
        logits = tl.load(logits_ptr + token * num_experts + experts, mask=real, other=float("-inf"),
                         cache_modifier=".cg").to(tl.float32)
        _pick(logits, real, token, ids_ptr, weights_ptr, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
        tl.atomic_xchg(count_ptr + token, 0, sem="relaxed", scope="gpu")


def route(logits: torch.Tensor, top_k: int, renormalize: bool, shared_logits: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [T, E] (any float dtype) -> (ids [T, top_k] int32, weights [T, top_k] fp32,
    sigmoid(shared_logits) [T, 1] in their dtype or None): softmax over the E experts in
    fp32, the top_k, renormalised to sum to one when asked. shared_logits: [T, 1]."""
    tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    assert logits.stride(1) == 1
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    shared_gate = None
    if shared_logits is not None:
        assert shared_logits.shape == (tokens, 1)
        shared_gate = torch.empty(tokens, 1, dtype=shared_logits.dtype, device=logits.device)
    if tokens == 0:
        return ids, weights, shared_gate
    block_e = triton.next_power_of_2(num_experts)
    _routing_kernel[(tokens,)](
        logits, ids, weights, shared_logits if shared_logits is not None else logits,
        shared_gate if shared_gate is not None else weights, num_experts, logits.stride(0),
        shared_logits.stride(0) if shared_logits is not None else 0,
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_SHARED=shared_logits is not None,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if block_e <= 256 else 4,
    )
    return ids, weights, shared_gate


# Tokens up to which SparseMoE computes its router logits inside the routing kernel
# (route_hidden): at decode batch sizes the router's matmul is a launch of its own for a
# few microseconds of reading a weight of E x H.
FUSED_GATE_MAX_TOKENS = 8


def route_hidden(x: torch.Tensor | PendingNorm, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                 shared_gate_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """route(x @ gate_weight^T, ..., x @ shared_gate_weight^T) in one launch: x [T, H];
    gate_weight [E, H] and shared_gate_weight [1, H] in x's dtype. The logits are summed in
    fp32 and rounded to x's dtype, as the router's linear leaves them. Each token's logits
    are computed by several programs, the last of which picks (a split-K counter per token,
    shared with the other split-K kernels': launches on one stream at a time). x a
    PendingNorm: its rows, the norm finished in the kernel (the logits scaled)."""
    pending = x if isinstance(x, PendingNorm) else None
    x = x.rows if pending is not None else x
    tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    assert gate_weight.shape[1] == hidden and gate_weight.dtype == x.dtype
    assert x.stride(1) == 1 and gate_weight.stride(1) == 1
    counters = split_counters(x.device)
    assert tokens <= counters.numel()
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    logits = torch.empty(tokens, num_experts, dtype=x.dtype, device=x.device)
    shared_gate = None
    if shared_gate_weight is not None:
        assert shared_gate_weight.shape == (1, hidden) and shared_gate_weight.stride(1) == 1
        shared_gate = torch.empty(tokens, 1, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return ids, weights, shared_gate
    block_e = triton.next_power_of_2(num_experts)
    # Loads in flight over the GPU, not a long loop in few programs: about 64 programs a
    # token (2 rows each for 128 experts), each loading 2048-element tiles. Past a few
    # experts, one warp a program: the last arriver's top-k over E lanes then reduces within
    # a warp, without shared-memory round trips (H200, 128 x 2048 bf16: 5.3 -> 4.5 us; 8
    # experts keep 4 warps, 3.3 us; benchmarks/gpu_moe_decode_kernels.py).
    rows = max(1, min(16, block_e // 64))
    block_h = max(256, 2048 // rows)
    num_warps = 4 if num_experts <= 8 else 1
    partials = pending.sums.shape[-1] if pending is not None else 1
    _gate_and_route_kernel[(tokens, triton.cdiv(num_experts, rows))](
        x, gate_weight, shared_gate_weight if shared_gate_weight is not None else gate_weight, logits, counters,
        ids, weights, shared_gate if shared_gate is not None else logits,
        pending.sums if pending is not None else weights, num_experts, hidden, x.stride(0), gate_weight.stride(0),
        partials, pending.eps if pending is not None else 0.0,
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_SHARED=shared_gate_weight is not None,
        ROWS=rows, BLOCK_H=block_h, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps,
        ROW_SCALE=pending is not None, PARTIALS=triton.next_power_of_2(partials), **pdl.chained_options(x.device),
    )
    return ids, weights, shared_gate
