"""A drafter's own small paged KV cache for one attention layer (EAGLE's draft layer), kept
like the target's: a pool of fixed-size blocks, a block table per sequence, blocks taken on
demand and given back when the sequence finishes or is preempted. Attention reads it through
the engine's paged attention backend (the torch reference on CPU, Triton on CUDA)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.selector import get_attn_backend
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.model_executor.block_tables import pack_block_tables
from kvserve.utils import lazy_zeros


def paged_cache_bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One layer's keys and values of a block of positions."""
    return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


class PagedDraftCache:
    """One layer's keys and values, [2, num_blocks, block_size, kv_heads, head_dim]. A
    sequence's positions 0, 1, .. live in the blocks of its table, taken from the pool by
    `reserve` and given back by `retain`. Its length is how many leading positions hold
    valid keys: truncating only lowers it (rejected drafts' positions are overwritten later;
    their blocks stay the sequence's until it ends)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, attention_backend: str = "auto") -> None:
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not garbage: the torch backend's padded gathers read unused slots (masked,
        # but a NaN there would still poison the softmax's products).
        self.kv = lazy_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        # No prefix caching: a sequence's blocks are private and freed with it.
        self.block_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.backend = get_attn_backend(device, attention_backend)
        self._lengths: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def length(self, seq_id: str) -> int:
        return self._lengths.get(seq_id, 0)

    def reserve(self, seq_id: str, num_positions: int) -> bool:
        """Blocks for `num_positions` positions past the sequence's length, taken from the
        pool as needed; False (nothing taken) when it has too few free blocks."""
        return self.block_manager.allocate_slots(seq_id, (), self.length(seq_id), num_positions) is not None

    def truncate(self, seq_id: str, length: int) -> None:
        self._lengths[seq_id] = min(self.length(seq_id), length)

    def retain(self, seq_ids: Iterable[str]) -> None:
        """Give back the blocks of every sequence not in `seq_ids`."""
        keep = set(seq_ids)
        for seq_id in [s for s in self.block_manager.block_tables if s not in keep]:
            self.block_manager.free(seq_id)
        for seq_id in [s for s in self._lengths if s not in keep]:
            del self._lengths[seq_id]

    def extend(self, seq_ids: Sequence[str], counts: Sequence[int]) -> DraftRows:
        """One attention call's rows: counts[i] new positions of seq_ids[i] past its length
        (reserved before), the sequences' rows one after another. The lengths grow by them."""
        starts = [self.length(seq_id) for seq_id in seq_ids]
        ends = [start + count for start, count in zip(starts, counts)]
        tables = [self.block_manager.block_ids(seq_id) for seq_id in seq_ids]
        for seq_id, end, table in zip(seq_ids, ends, tables):
            if end > len(table) * self.block_size:
                raise RuntimeError(f"draft cache: {seq_id} writes position {end - 1}, past its "
                                   f"{len(table)} reserved blocks of {self.block_size}")
        block_tables = pack_block_tables(tables)
        positions = torch.cat([torch.arange(start, end) for start, end in zip(starts, ends)])
        seq_index = torch.repeat_interleave(torch.arange(len(seq_ids)), torch.tensor(counts))
        slots = block_tables[seq_index, positions // self.block_size].long() * self.block_size
        query_start_loc = [0, *itertools.accumulate(counts)]
        device = self.kv.device
        metadata = AttentionMetadata(
            slot_mapping=(slots + positions % self.block_size).to(device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device), block_size=self.block_size,
            max_query_len=max(counts), max_seq_len=max(ends),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=ends,
        )
        self._lengths.update(zip(seq_ids, ends))
        return DraftRows(self, metadata)


@dataclass
class DraftRows:
    """New rows of one attention call over a PagedDraftCache (PagedDraftCache.extend)."""

    cache: PagedDraftCache
    metadata: AttentionMetadata

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[m, heads x head_dim]: k and v [m, kv_heads, head_dim] written at the rows'
        positions, then each of q's m rows [m, heads, head_dim] attends its sequence's
        positions up to its own."""
        attended = self.cache.backend.forward(q, k, v, self.cache.kv, self.metadata, scale=q.shape[-1] ** -0.5)
        return attended.reshape(q.shape[0], -1)
