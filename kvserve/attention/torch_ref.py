"""Paged attention in plain torch: the oracle for other kernels and the CPU path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.model_executor.layers.rotary import apply_rotary
from kvserve.ops import cpu as cpu_kernels


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


def attends_in_place(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether kvserve's CPU decode attention kernel takes these decodes: it reads an fp32
    cache in place, where the torch path gathers a padded copy of the context for SDPA."""
    return (query.device.type == "cpu" and query.dtype == kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and cpu_kernels.available())


# Most context positions (sequences x padded length) gathered at once by the decode path:
# bounds its transient memory, which the KV-cache sizing does not profile.
MAX_DECODE_GATHER_POSITIONS = 1 << 18
# Query spans of up to this many tokens are attended as decode rows (_plan).
SHORT_QUERY_MAX_ROWS = 16


class TorchReferenceBackend(AttentionBackend):
    """Prefill chunks are attended one sequence at a time; single-token decodes in groups:
    over an fp32 CPU cache, by kvserve's kernel reading the cache in place, otherwise by one
    padded gather and one masked batched attention per group. The slots and masks are the
    same for every layer of a step: the first layer plans them (per metadata), the others
    reuse the plan, which takes ~10 small ops per layer off a CPU decode step. Given a
    DecodeContext instead (the compiled CPU decode), it attends without writing the cache."""

    fuses_rotary = False

    def __init__(self, sliding_window: int | None = None, decode_kernel: bool = True) -> None:
        self.sliding_window = sliding_window
        # Decodes over an fp32 CPU cache go through kvserve's kernel where it is built
        # (attends_in_place); False keeps the gathered copy and SDPA (side-by-side timing).
        self.decode_kernel = decode_kernel

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata | DecodeContext,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        in_place = self.decode_kernel and attends_in_place(query, kv_cache)
        if isinstance(metadata, DecodeContext):
            return decode_context_attention(query, key, value, kv_cache, metadata, scale, in_place)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)
        flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
        output = torch.empty_like(query)
        plan = metadata.backend_plans.get("torch_ref")
        if plan is None:
            plan = metadata.backend_plans["torch_ref"] = _plan(metadata, self.sliding_window)
        for group in plan.decode_groups:
            if in_place:
                output[group.token_index] = torch.ops.kvserve_cpu.decode_attention(
                    query[group.token_index], kv_cache, group.slots, group.valid, None, None, scale)
                continue
            q = query[group.token_index].float().view(group.size, num_kv_heads, -1, head_dim)
            # [B, KVH, H/KVH, D] queries against [B, KVH, max_len, D]: each KV head is read
            # once for its whole group, with no expanded copy of K/V.
            k = gather_cache(flat_k, group.slots, kv_scales[0]).transpose(1, 2)
            v = gather_cache(flat_v, group.slots, kv_scales[1]).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.valid[:, None, None, :], scale=scale)
            output[group.token_index] = out.reshape(group.size, -1, head_dim).to(output.dtype)
        for chunk in plan.prefill_chunks:
            # 4-D inputs ([1, H, q_len, D] against [1, KVH, len, D]): on CPU, SDPA then takes
            # its fused flash kernel (masks and GQA included) instead of the math path,
            # 2-3x less time for 128-512 token chunks.
            q = query[chunk.start : chunk.end].float().transpose(0, 1)[None]
            k = gather_cache(flat_k, chunk.slots, kv_scales[0]).transpose(0, 1)[None]
            v = gather_cache(flat_v, chunk.slots, kv_scales[1]).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True
            )
            output[chunk.start : chunk.end] = out[0].transpose(0, 1).to(output.dtype)
        return output


@dataclass
class DecodeContext:
    """A step of a few query rows (single-token decodes, or the 1 + k rows of verify steps)
    in a form torch.compile traces (tensors only, no host lists): each query attends to its
    sequence's cached context, gathered through `slots`, and to the step's new keys/values
    that `new_valid` lets it see (its own, and its sequence's earlier rows or tree
    ancestors), which are collected in `new_kv` for the caller to write into the cache after
    the forward. Writing into the cache inside the graph would make inductor copy the whole
    cache (a graph input it cannot mutate in place) every step. Not for float8 caches (the
    new key/value are not scaled)."""

    slots: torch.Tensor  # [T, C] cache slot of each cached context position (padded)
    valid: torch.Tensor  # [T, C] bool: cached positions each query sees
    new_valid: torch.Tensor  # [T, T] bool: the step's new tokens each query sees
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def decode_context(metadata: AttentionMetadata, sliding_window: int | None, min_cached: int = 0) -> DecodeContext:
    """The DecodeContext of a step: row r of a sequence feeding q tokens sits at position
    seq_len - q + j, sees the cached positions before seq_len - q and the step's rows of its
    sequence up to itself (or, for a token tree, its ancestors). The context is padded
    (masked) to at least `min_cached` positions."""
    device = metadata.block_tables.device
    starts = metadata.query_start_loc_cpu
    query_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=device)
    num_rows = starts[-1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens,
                                         output_size=num_rows)
    cached = metadata.seq_lens.long() - query_lens  # [B] positions already in the cache
    row = torch.arange(num_rows, device=device)
    row_cached = cached[seq_of_row]
    row_position = row_cached + row - torch.tensor(starts[:-1], device=device)[seq_of_row]
    query_lens_cpu = (b - a for a, b in zip(starts, starts[1:]))
    num_cached = max(min_cached, *(s - q for s, q in zip(metadata.seq_lens_cpu, query_lens_cpu)))
    key_pos = torch.arange(num_cached, device=device)[None, :]
    valid = key_pos < row_cached[:, None]
    new_valid = (seq_of_row[:, None] == seq_of_row[None, :]) & (row[None, :] <= row[:, None])
    for seq, mask in (metadata.tree_masks or {}).items():
        new_valid[starts[seq] : starts[seq + 1], starts[seq] : starts[seq + 1]] = mask
    if sliding_window is not None:  # keys p - sliding_window < k <= p
        valid &= key_pos > row_position[:, None] - sliding_window
        new_valid &= row_position[None, :] > row_position[:, None] - sliding_window
    slots = context_slots(metadata.block_tables[seq_of_row], num_cached, metadata.block_size)
    return DecodeContext(slots, valid, new_valid)


def decode_context_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    context: DecodeContext, scale: float, in_place: bool,
) -> torch.Tensor:
    """[T, H, D] attention of T query rows over [cached context, the step's new tokens],
    read in place by kvserve's CPU kernel or gathered for SDPA."""
    num_rows = query.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    context.new_kv.append((key, value))
    if in_place:
        return torch.ops.kvserve_cpu.decode_attention(
            query, kv_cache, context.slots, context.valid, key, value, scale, context.new_valid)
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
    # The new keys/values round-trip through the cache dtype, as the eager path reads them.
    new_k = key.to(kv_cache.dtype)[None].expand(num_rows, -1, -1, -1)
    new_v = value.to(kv_cache.dtype)[None].expand(num_rows, -1, -1, -1)
    k = torch.cat([flat_k[context.slots], new_k], dim=1)
    v = torch.cat([flat_v[context.slots], new_v], dim=1)
    mask = torch.cat([context.valid, context.new_valid], dim=1)
    q = query.float().view(num_rows, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale,
    )
    return out.reshape(num_rows, -1, head_dim).to(query.dtype)


@dataclass
class _DecodeGroup:
    """Single-token decodes attended together: one padded gather, one masked attention."""

    token_index: torch.Tensor  # [B] the decodes' rows in the flat batch
    slots: torch.Tensor  # [B, max_len] cache slot of each context position
    valid: torch.Tensor  # [B, max_len] positions each decode sees

    @property
    def size(self) -> int:
        return self.token_index.numel()


@dataclass
class _PrefillChunk:
    start: int  # the chunk's rows start:end in the flat batch
    end: int
    slots: torch.Tensor  # [seq_len] cache slot of each context position
    mask: torch.Tensor  # [q_len, seq_len] positions each query sees


@dataclass
class _Plan:
    decode_groups: list[_DecodeGroup]
    prefill_chunks: list[_PrefillChunk]


def _plan(metadata: AttentionMetadata, sliding_window: int | None) -> _Plan:
    """Slots and masks of one step, the same for every layer. With a sliding window, a
    query at position p sees keys p - sliding_window < k <= p (Mistral, as transformers).
    Sequences feeding at most SHORT_QUERY_MAX_ROWS tokens (decodes, verify steps, short
    chunks) are attended row by row as decodes, each row over the context up to itself: over
    an fp32 CPU cache that is the in-place kernel (each row computed exactly as a decode at
    its position), where the prefill path would gather a copy of the context per layer."""
    device = metadata.block_tables.device
    starts = metadata.query_start_loc_cpu
    seq_lens = metadata.seq_lens_cpu
    row_seqs, row_lens, row_tokens = [], [], []
    for i in range(metadata.num_seqs):
        num_queries = starts[i + 1] - starts[i]
        if 1 <= num_queries <= SHORT_QUERY_MAX_ROWS:
            row_seqs.extend([i] * num_queries)
            row_lens.extend(range(seq_lens[i] - num_queries + 1, seq_lens[i] + 1))
            row_tokens.extend(range(starts[i], starts[i + 1]))
    groups = []
    for rows in _decode_groups(list(range(len(row_seqs))), row_lens):
        seq_index = torch.tensor([row_seqs[r] for r in rows], device=device)
        lens = [row_lens[r] for r in rows]
        max_len = max(lens)
        # Padding positions past each row's own position are masked out.
        key_pos = torch.arange(max_len, device=device)[None, :]
        row_len = torch.tensor(lens, device=device)[:, None]
        valid = key_pos < row_len
        if metadata.tree_masks:
            for g, r in enumerate(rows):
                mask = metadata.tree_masks.get(row_seqs[r])
                if mask is not None:  # the row's own query index j sees mask[j, :j + 1]
                    first = seq_lens[row_seqs[r]] - mask.shape[0]
                    j = row_lens[r] - 1 - first
                    valid[g, first : first + j + 1] = mask[j, : j + 1]
        if sliding_window is not None:  # the query sits at row_len - 1
            valid &= key_pos >= row_len - sliding_window
        groups.append(_DecodeGroup(
            token_index=torch.tensor([row_tokens[r] for r in rows], device=device),
            slots=context_slots(metadata.block_tables[seq_index], max_len, metadata.block_size),
            valid=valid,
        ))
    chunks = []
    for i in range(metadata.num_seqs):
        start, end = starts[i], starts[i + 1]
        if end - start <= SHORT_QUERY_MAX_ROWS:
            continue
        seq_len = seq_lens[i]
        # Query j sits at context position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=device)
        k_pos = torch.arange(seq_len, device=device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if metadata.tree_masks and i in metadata.tree_masks:
            mask[:, seq_len - (end - start) :] = metadata.tree_masks[i]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        slots = context_slots(metadata.block_tables[i : i + 1], seq_len, metadata.block_size)[0]
        chunks.append(_PrefillChunk(start, end, slots, mask))
    return _Plan(groups, chunks)


def _decode_groups(decode_rows: list[int], row_lens: list[int]) -> list[list[int]]:
    """Consecutive groups whose padded gather stays under MAX_DECODE_GATHER_POSITIONS."""
    groups: list[list[int]] = []
    group: list[int] = []
    group_max = 0
    for i in decode_rows:
        longest = max(group_max, row_lens[i])
        if group and longest * (len(group) + 1) > MAX_DECODE_GATHER_POSITIONS:
            groups.append(group)
            group, longest = [], row_lens[i]
        group.append(i)
        group_max = longest
    if group:
        groups.append(group)
    return groups
