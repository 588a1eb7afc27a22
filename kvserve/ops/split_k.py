"""Split-K without a second kernel: the programs that share an output tile each leave their
fp32 partials, count their arrival on the tile's counter, and the last to arrive sums the
partials in split order (deterministic: no atomics on data), finishes the tile and re-arms
the counter for the next launch. The weight-only and fp8 W8A8 matmuls, the dense GEMV and
the MoE router's logits use it."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# One counter per output tile; each launch leaves them at 0. Shared by every launch on the
# device: launches must not overlap (one stream at a time).
MAX_SPLIT_COUNTERS = 16384


@functools.lru_cache(maxsize=None)
def split_counters(device: torch.device) -> torch.Tensor:
    """The device's MAX_SPLIT_COUNTERS arrival counters (int32, all 0 between launches)."""
    return torch.zeros(MAX_SPLIT_COUNTERS, dtype=torch.int32, device=device)


@triton.jit
def _split_counter(count_ptr):
    """The arrival counter of this program's output tile."""
    return count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def arrives_last(accs, partial_ptr, count_ptr, offss, masks, stride_ps):
    """Leave this split's fp32 partials (a tuple of blocks, one counter for them all) and
    say whether it is the last of its output tile's splits to arrive (an acq_rel counter)."""
    for i in tl.static_range(len(accs)):
        tl.store(partial_ptr + tl.program_id(2) * stride_ps + offss[i], accs[i], mask=masks[i])
    tl.debug_barrier()  # every thread's partial is written before thread 0 releases them
    return tl.atomic_add(_split_counter(count_ptr), 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1


@triton.jit
def summed_splits(partial_ptr, offs, mask, stride_ps, IN_FLIGHT: tl.constexpr = 1):
    """The splits' partials of one block, summed in split order (deterministic). This sum is
    the tail a split-K call ends on; the loads go out IN_FLIGHT at a time (masked past the
    last split): the word kernels WORD_SPLITS_IN_FLIGHT, the mma.sync kernels 1 (the
    compiler unrolls that loop by 4; the same sm_90 code as a plain loop)."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for first in range(0, tl.num_programs(2), IN_FLIGHT):
        for i in tl.static_range(IN_FLIGHT):
            split = first + i
            total += tl.load(partial_ptr + split * stride_ps + offs, mask=mask & (split < tl.num_programs(2)),
                             other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def rearm(count_ptr):
    """Reset the output tile's counter for the next launch (its last split calls this)."""
    tl.atomic_xchg(_split_counter(count_ptr), 0, sem="relaxed", scope="gpu")


@triton.jit
def store_summed_splits(accs, partial_ptr, out_ptr, count_ptr, offss, masks, stride_ps, IN_FLIGHT: tl.constexpr):
    """Every split leaves its partials (a tuple of blocks), and the last of an output tile's
    splits to arrive sums them all, writes the output and re-arms the counter."""
    if arrives_last(accs, partial_ptr, count_ptr, offss, masks, stride_ps):
        for i in tl.static_range(len(accs)):
            total = summed_splits(partial_ptr, offss[i], masks[i], stride_ps, IN_FLIGHT)
            tl.store(out_ptr + offss[i], total.to(out_ptr.dtype.element_ty), mask=masks[i])
        rearm(count_ptr)
