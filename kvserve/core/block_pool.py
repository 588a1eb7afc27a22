"""Physical KV blocks: a free list, reference counts, and the prefix-cache index.

A block is in exactly one of three states:
  * in use: ref_count > 0 (held by one or more block tables);
  * free and cached: ref_count == 0 but its hash is still registered, so a later request
    with the same prefix can revive it; evicted least-recently-freed first;
  * free and uncached: ref_count == 0 and no hash; handed out before evicting cached ones,
    most recently freed first (on CPU its cache pages are already resident: reusing them
    keeps the process from faulting in the rest of a large cache).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chained hash of the tokens in this block and everything before it; set once full.
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._uncached_free: deque[KVBlock] = deque(self.blocks)
        # Free blocks whose hash is still registered, oldest-freed first (LRU order).
        self._evictable: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[int, KVBlock] = {}
        # Kept in step with the ref counts, so the sharing gauges cost nothing to read:
        # references held in all, and blocks held by more than one table.
        self.num_references = 0
        self.num_shared_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + len(self._evictable)

    @property
    def num_cached_evictable_blocks(self) -> int:
        return len(self._evictable)

    def cached_free_block_ids(self) -> list[int]:
        """Ids of the free blocks a prefix hit can still revive."""
        return list(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self) -> KVBlock:
        """A fresh block with ref_count 1; evicts the LRU cached block if nothing else is free."""
        if self._uncached_free:
            block = self._uncached_free.pop()  # most recently freed: its pages are resident
        elif self._evictable:
            _, block = self._evictable.popitem(last=False)
            del self._cached[block.block_hash]
            block.block_hash = None
        else:
            raise RuntimeError("no free KV blocks (caller must check num_free_blocks)")
        block.ref_count = 1
        self.num_references += 1
        return block

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def acquire(self, block: KVBlock) -> None:
        """Take one more reference to a block that is in use or cached."""
        if block.ref_count == 0:
            del self._evictable[block.block_id]
        block.ref_count += 1
        self.num_references += 1
        self.num_shared_blocks += block.ref_count == 2

    def release(self, block: KVBlock) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block.block_id} released more often than acquired")
        block.ref_count -= 1
        self.num_references -= 1
        self.num_shared_blocks -= block.ref_count == 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block.block_id] = block
            else:
                self._uncached_free.append(block)

    def register(self, block: KVBlock, block_hash: int) -> None:
        """Make a full, in-use block findable by its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block (e.g. after weights change)."""
        for block in self._evictable.values():
            del self._cached[block.block_hash]
            block.block_hash = None
            self._uncached_free.append(block)
        self._evictable.clear()
