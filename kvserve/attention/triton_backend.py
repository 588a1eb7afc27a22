"""The Triton attention backend: the GPU path of every attention layer."""

from __future__ import annotations

import logging
import time

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.ops.attention.kv_cache_write import write_kv_cache
from kvserve.ops.attention.paged_attention import (
    DecodePlan,
    NewKV,
    choose_decode_plan,
    fuses_new_kv,
    paged_attention,
    warm_up as warm_up_kernels,
)
from kvserve.ops.elementwise import rotary_queries_and_keys_

logger = logging.getLogger(__name__)


class TritonAttentionBackend(AttentionBackend):
    """Writes the step's K/V into the paged cache, then runs one attention kernel over the
    whole varlen batch: decode-only batches get a decode tile and, when few sequences
    would leave the chip idle, a split-KV (flash-decoding) pass (choose_decode_plan); other
    batches a prefill tile. No host sync: every launch size comes from the metadata's host
    fields. Given RoPE's (cos, sin), narrow decode and verify batches rotate q and k and
    write the new K/V inside the attention kernel (fuses_new_kv); other batches rotate them
    first."""

    fuses_rotary = True

    def __init__(self, num_kv_splits: int | None = None) -> None:
        # None: chosen per decode batch; a number pins it (tests; CUDA graphs need one
        # grid per captured batch size).
        self.num_kv_splits = num_kv_splits

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype, block_size: int,
                max_width: int = 1) -> None:
        """Compile (or load from Triton's cache) every attention kernel variant now, those of
        verify steps up to max_width tokens a sequence included."""
        start = time.perf_counter()
        launches = warm_up_kernels(kv_cache, num_heads, dtype, block_size, max_width)
        torch.cuda.synchronize(kv_cache.device)
        logger.info("attention kernels: %d variants ready in %.1f s", launches, time.perf_counter() - start)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        tree_bits = metadata.tree_bits
        if tree_bits is None and metadata.tree_masks:
            tree_bits = metadata.backend_plans.get("tree_bits")
            if tree_bits is None:  # the first layer's: every layer of the step has the same
                tree_bits = metadata.backend_plans["tree_bits"] = query_visibility_bits(metadata, query.device)
        if query.stride(-1) != 1:
            query = query.contiguous()
        plan = metadata.decode_plan
        if plan is None:
            plan = (DecodePlan(self.num_kv_splits) if self.num_kv_splits is not None
                    else choose_decode_plan(metadata, kv_cache.shape[3], kv_cache.dtype, query.device))
        assert rotary is None or kv_cache.element_size() > 1, "float8 caches take keys rotated and in their basis"
        new_kv = None
        group = query.shape[1] // kv_cache.shape[3]
        if rotary is not None and fuses_new_kv(metadata, plan.tile, query.dtype, kv_cache.dtype, group):
            new_kv = NewKV(key, value, *rotary)
        else:
            if rotary is not None:
                rotary_queries_and_keys_(query, key, *rotary)
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        paged_attention(query, kv_cache, metadata, scale, output, plan.num_kv_splits, tile=plan.tile,
                        kv_scales=kv_scales, new_kv=new_kv, tree_bits=tree_bits)
        return output


def query_visibility_bits(metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """[T] int64 for the Triton kernel's token-tree masks: bit j of a token's value is set
    where it sees its sequence's j-th query token of the step. Sequences without a tree mask
    get every bit (their causal mask applies alone); a tree's mask rows become bits."""
    from kvserve.spec_decode.tree import mask_row_bits

    bits = [-1] * metadata.query_start_loc_cpu[-1]
    for seq, mask in (metadata.tree_masks or {}).items():
        start = metadata.query_start_loc_cpu[seq]
        bits[start : start + mask.shape[0]] = mask_row_bits(mask)
    return torch.tensor(bits, dtype=torch.int64).to(device, non_blocking=True)
