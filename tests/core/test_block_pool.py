"""Property tests for BlockPool: ref counts, the three block states, LRU eviction.

Every check compares the pool against an independent model kept by the test:
  * holders: a multiset of block ids (one entry per reference taken);
  * registered: hash -> block id for every block whose hash the pool should still know;
  * evict_order: free blocks that are still registered, least recently freed first;
  * uncached: free blocks without a hash.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.core.block_pool import BlockPool


# -- deterministic examples --------------------------------------------------------------


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_release_more_than_acquired_raises():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.acquire(block)
    pool.release(block)
    pool.release(block)
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.release(block)
    # A never-allocated block cannot be released either.
    with pytest.raises(RuntimeError):
        pool.release(pool.blocks[1])
    assert pool.num_free_blocks == 2
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_allocate_from_empty_pool_raises():
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_uncached_blocks_are_used_before_evicting_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = (pool.allocate() for _ in range(4))
    pool.register(a, 100)
    pool.register(b, 200)
    # Free the cached blocks first, the uncached ones last.
    pool.release(b)
    pool.release(a)
    pool.release(c)
    pool.release(d)
    assert pool.num_free_blocks == 4
    assert pool.num_cached_evictable_blocks == 2
    got = {pool.allocate().block_id, pool.allocate().block_id}
    assert got == {c.block_id, d.block_id}
    # Both cached blocks are still findable.
    assert pool.lookup(100) is a and pool.lookup(200) is b
    # Now eviction: least recently freed first (b was freed before a).
    assert pool.allocate() is b
    assert pool.lookup(200) is None and b.block_hash is None
    assert pool.lookup(100) is a
    assert pool.allocate() is a
    assert pool.lookup(100) is None
    assert pool.num_free_blocks == 0


def test_revived_cached_block_leaves_eviction_order():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, blk in enumerate(blocks):
        pool.register(blk, 10 + i)
    for blk in blocks:
        pool.release(blk)  # LRU order: 0, 1, 2
    assert pool.num_cached_evictable_blocks == 3
    pool.acquire(pool.lookup(10))  # revive the oldest
    assert pool.num_free_blocks == 2
    assert pool.allocate() is blocks[1]
    pool.release(blocks[0])  # now the most recently freed
    assert pool.allocate() is blocks[2]
    assert pool.allocate() is blocks[0]


def test_register_first_writer_wins_and_caching_off():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 7)
    pool.register(b, 7)
    assert pool.lookup(7) is a and b.block_hash is None
    pool.register(a, 8)  # a block keeps its first hash
    assert pool.lookup(8) is None and a.block_hash == 7

    off = BlockPool(2, enable_caching=False)
    x = off.allocate()
    off.register(x, 7)
    assert off.lookup(7) is None and x.block_hash is None
    off.release(x)
    assert off.num_cached_evictable_blocks == 0 and off.num_free_blocks == 2


def test_reset_prefix_cache_forgets_only_free_blocks():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 1)
    pool.register(b, 2)
    pool.release(a)
    pool.reset_prefix_cache()
    assert pool.lookup(1) is None and a.block_hash is None
    assert pool.lookup(2) is b  # still in use, still cached
    assert pool.num_cached_evictable_blocks == 0
    assert pool.num_free_blocks == 2


# -- stateful model ----------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None

    @initialize(num_blocks=st.integers(1, 8), caching=st.booleans())
    def init(self, num_blocks, caching):
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.n = num_blocks
        self.caching = caching
        self.holders: Counter[int] = Counter()
        self.registered: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.evict_order: list[int] = []
        self.uncached: set[int] = set(range(num_blocks))
        self.next_hash = 1000

    def _free(self) -> int:
        return len(self.uncached) + len(self.evict_order)

    @rule()
    def allocate(self):
        if self._free() == 0:
            with pytest.raises(RuntimeError):
                self.pool.allocate()
            return
        block = self.pool.allocate()
        bid = block.block_id
        if self.uncached:
            assert bid in self.uncached, "a cached block was evicted while uncached ones were free"
            self.uncached.remove(bid)
        else:
            assert bid == self.evict_order[0], "eviction is not least-recently-freed first"
            self.evict_order.pop(0)
            del self.registered[self.block_hash.pop(bid)]
        assert block.ref_count == 1
        assert block.block_hash is None
        self.holders[bid] += 1

    @rule(data=st.data())
    def acquire_in_use(self, data):
        if not self.holders:
            return
        bid = data.draw(st.sampled_from(sorted(self.holders)))
        self.pool.acquire(self.pool.blocks[bid])
        self.holders[bid] += 1

    @rule(data=st.data())
    def revive_cached(self, data):
        if not self.registered:
            return
        h = data.draw(st.sampled_from(sorted(self.registered)))
        block = self.pool.lookup(h)
        assert block is not None and block.block_id == self.registered[h]
        self.pool.acquire(block)
        if block.block_id in self.evict_order:
            self.evict_order.remove(block.block_id)
        self.holders[block.block_id] += 1

    @rule(data=st.data())
    def release(self, data):
        if not self.holders:
            return
        bid = data.draw(st.sampled_from(sorted(self.holders)))
        self.pool.release(self.pool.blocks[bid])
        self.holders[bid] -= 1
        if self.holders[bid] == 0:
            del self.holders[bid]
            if bid in self.block_hash:
                self.evict_order.append(bid)
            else:
                self.uncached.add(bid)

    @rule(data=st.data())
    def over_release_raises(self, data):
        free = sorted(set(range(self.n)) - set(self.holders))
        if not free:
            return
        bid = data.draw(st.sampled_from(free))
        with pytest.raises(RuntimeError):
            self.pool.release(self.pool.blocks[bid])

    @rule(data=st.data(), reuse=st.booleans())
    def register(self, data, reuse):
        if not self.holders:
            return
        bid = data.draw(st.sampled_from(sorted(self.holders)))
        if reuse and self.registered:
            h = data.draw(st.sampled_from(sorted(self.registered)))
        else:
            h = self.next_hash
            self.next_hash += 1
        self.pool.register(self.pool.blocks[bid], h)
        if self.caching and bid not in self.block_hash and h not in self.registered:
            self.block_hash[bid] = h
            self.registered[h] = bid

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        for bid in self.evict_order:
            del self.registered[self.block_hash.pop(bid)]
            self.uncached.add(bid)
        self.evict_order.clear()

    @invariant()
    def matches_model(self):
        if self.pool is None:
            return
        pool = self.pool
        for block in pool.blocks:
            assert block.ref_count == self.holders.get(block.block_id, 0)
            assert block.block_hash == self.block_hash.get(block.block_id)
        in_use = sum(1 for b in pool.blocks if b.ref_count > 0)
        assert in_use == len(self.holders)
        assert len(self.uncached) + len(self.evict_order) + in_use == self.n
        assert pool.num_free_blocks == len(self.uncached) + len(self.evict_order)
        assert pool.num_cached_evictable_blocks == len(self.evict_order)
        assert pool.usage == pytest.approx(in_use / self.n)
        for h, bid in self.registered.items():
            assert pool.lookup(h) is pool.blocks[bid]
        assert pool.lookup(-1) is None


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
