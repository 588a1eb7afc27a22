"""Which sequence holds each KV block, for the dashboard's block map: read from the block
pool and the block tables that the KV report counts. A pass over every block, so it is
built only when a dashboard asks for it, never by a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.core.kv_cache_manager import KVCacheManager

# A block's code in the map: its state, or FIRST_OWNER + k when owners[k] alone holds it.
FREE, CACHED, SHARED = 0, 1, 2
FIRST_OWNER = 3


@dataclass
class BlockMap:
    """`runs` is the map run-length encoded, [code, count, code, count, ...] in block id
    order: a cache of 100,000 blocks is mostly long runs (free space, a sequence's blocks
    taken off the free list together), so an update stays small."""

    owners: list[str]
    runs: list[int]

    def codes(self) -> list[int]:
        """One code per block, in block id order."""
        return [code for i in range(0, len(self.runs), 2) for code in [self.runs[i]] * self.runs[i + 1]]


def build_block_map(kv_cache: KVCacheManager, owner_of: Callable[[str], str]) -> BlockMap:
    """Each block's state: held by one table (coloured by `owner_of(sequence id)`, e.g. its
    request, so a request's samples share a colour), by several (prefix sharing, forks
    before their copy-on-write), free but cached (a prefix hit can revive it), or free."""
    pool = kv_cache.pool
    codes = [FREE] * pool.num_blocks
    for block_id in pool.cached_free_block_ids():
        codes[block_id] = CACHED
    owner_index: dict[str, int] = {}
    for seq_id, table in kv_cache.block_tables.items():
        code = None  # an owner is listed once it holds a block alone
        for block in table:
            if block.ref_count > 1:
                codes[block.block_id] = SHARED
                continue
            if code is None:
                code = FIRST_OWNER + owner_index.setdefault(owner_of(seq_id), len(owner_index))
            codes[block.block_id] = code
    return BlockMap(list(owner_index), _run_lengths(codes))


def _run_lengths(codes: list[int]) -> list[int]:
    runs: list[int] = []
    for code in codes:
        if runs and runs[-2] == code:
            runs[-1] += 1
        else:
            runs += [code, 1]
    return runs
