"""A mixture of experts' routing in one launch: router logits [T, E] -> each token's top_k
expert ids and routing weights, as SparseMoE defines them (a softmax over all E experts in
fp32, the top_k kept, and with `renormalize` scaled to sum to one), where torch takes a
cast, a softmax, a top-k, a sum and a division (five launches a layer, which at batch 1 cost
more than the arithmetic). Qwen2-MoE's shared-expert gate, sigmoid(its logit), rides along.

One program per token holds the token's E logits (E up to a few hundred) in registers and
picks the top_k by repeated arg-max. The choice is made on the logits, which the softmax
orders the same way, so it does not depend on how exp rounds: exactly equal logits go to the
lower expert index, and the choices come out by weight descending, ties by index ascending
(torch.topk on CUDA picks the same set; it leaves the order among equal weights
unspecified). No host reads: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _routing_kernel(logits_ptr, ids_ptr, weights_ptr, shared_logits_ptr, shared_gate_ptr, num_experts,
                    stride_t, stride_shared, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids[t] (int32) and weights[t] (fp32) of token t's top TOP_K experts; HAS_SHARED:
    shared_gate[t] = sigmoid(shared_logits[t]) in their dtype."""
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    x = tl.load(logits_ptr + token * stride_t + experts, mask=real, other=float("-inf")).to(tl.float32)
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
    if HAS_SHARED:
        g = tl.load(shared_logits_ptr + token * stride_shared).to(tl.float32)
        tl.store(shared_gate_ptr + token, (1.0 / (1.0 + tl.exp(-g))).to(shared_gate_ptr.dtype.element_ty))


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
