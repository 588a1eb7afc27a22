"""Paged attention in plain torch: the oracle for other kernels and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.metadata import AttentionMetadata


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def as_storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a dtype that indexing kernels support everywhere: float8 tensors are
    viewed as their bytes (CPU index_copy_ and gathers have no float8 kernels)."""
    return cache.view(torch.uint8) if cache.dtype in FLOAT8_DTYPES else cache


def gather_cache(flat: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """flat[slots] in fp32, for a cache of any storage dtype."""
    values = as_storage(flat)[slots].view(flat.dtype).float()
    return values * scale if flat.dtype in FLOAT8_DTYPES else values


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache's dtype; float8 is scaled and saturated (a plain cast overflows to NaN)."""
    if dtype not in FLOAT8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Scatter [T, KVH, D] key/value rows into their flat cache slots."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)
    storage = as_storage(flat_cache)
    k_scale, v_scale = kv_scales
    storage[0].index_copy_(0, slot_mapping, as_storage(to_cache_dtype(key, kv_cache.dtype, k_scale)))
    storage[1].index_copy_(0, slot_mapping, as_storage(to_cache_dtype(value, kv_cache.dtype, v_scale)))


def context_slots(block_tables: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """[B, num_positions] flat cache slot of each context position 0..num_positions-1."""
    positions = torch.arange(num_positions, device=block_tables.device)
    blocks = block_tables[:, positions // block_size].long()
    return blocks * block_size + positions % block_size


# Most context positions (sequences x padded length) gathered at once by the decode path:
# bounds its transient memory, which the KV-cache sizing does not profile.
MAX_DECODE_GATHER_POSITIONS = 1 << 18


class TorchReferenceBackend:
    """Prefill chunks are attended one sequence at a time; single-token decodes in groups,
    each one padded gather and one masked batched attention. With a sliding window, a
    query at position p sees keys p - sliding_window < k <= p (Mistral, as transformers)."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)
        flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        decode_seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        prefill_seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] > 1]

        for group in _decode_groups(decode_seqs, metadata.seq_lens_cpu):
            self._decode(
                query, flat_k, flat_v, output, metadata, group, scale, self.sliding_window, kv_scales
            )
        for i in prefill_seqs:
            start, end = starts[i], starts[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            slots = context_slots(metadata.block_tables[i : i + 1], seq_len, metadata.block_size)[0]
            q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
            k = gather_cache(flat_k, slots, kv_scales[0]).transpose(0, 1)  # [KVH, seq_len, D]
            v = gather_cache(flat_v, slots, kv_scales[1]).transpose(0, 1)
            # Query j sits at context position seq_len - q_len + j.
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if metadata.tree_masks and i in metadata.tree_masks:
                mask[:, seq_len - (end - start) :] = metadata.tree_masks[i]
            if self.sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            output[start:end] = out.transpose(0, 1).to(output.dtype)
        return output

    @staticmethod
    def _decode(
        query: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        output: torch.Tensor,
        metadata: AttentionMetadata,
        decode_seqs: list[int],
        scale: float,
        sliding_window: int | None,
        kv_scales: tuple[float, float],
    ) -> None:
        device = query.device
        seq_index = torch.tensor(decode_seqs, device=device)
        token_index = torch.tensor(
            [metadata.query_start_loc_cpu[i] for i in decode_seqs], device=device
        )
        max_len = max(metadata.seq_lens_cpu[i] for i in decode_seqs)
        slots = context_slots(metadata.block_tables[seq_index], max_len, metadata.block_size)
        num_kv_heads, head_dim = flat_k.shape[1:]
        # Group query heads by the KV head they share ([B, KVH, H/KVH, D]): each KV head is
        # read once for its whole group, with no expanded copy of K/V.
        q = query[token_index].float().view(len(decode_seqs), num_kv_heads, -1, head_dim)
        k = gather_cache(flat_k, slots, kv_scales[0]).transpose(1, 2)  # [B, KVH, max_len, D]
        v = gather_cache(flat_v, slots, kv_scales[1]).transpose(1, 2)
        # Padding positions past each sequence's length are masked out.
        key_pos = torch.arange(max_len, device=device)[None, :]
        seq_lens = metadata.seq_lens[seq_index, None]
        valid = key_pos < seq_lens
        if sliding_window is not None:  # the query sits at seq_len - 1
            valid &= key_pos >= seq_lens - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
        output[token_index] = out.reshape(len(decode_seqs), -1, head_dim).to(output.dtype)


def _decode_groups(decode_seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Consecutive groups whose padded gather stays under MAX_DECODE_GATHER_POSITIONS."""
    groups: list[list[int]] = []
    group: list[int] = []
    group_max = 0
    for i in decode_seqs:
        longest = max(group_max, seq_lens[i])
        if group and longest * (len(group) + 1) > MAX_DECODE_GATHER_POSITIONS:
            groups.append(group)
            group, longest = [], seq_lens[i]
        group.append(i)
        group_max = longest
    if group:
        groups.append(group)
    return groups
