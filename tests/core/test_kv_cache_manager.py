"""Property tests for KVCacheManager: block tables, prefix hits, forks, copy-on-write.

The stateful test keeps its own model of everything: each sequence's tokens, number of
computed tokens and block table; which full-block prefixes are cached in which block;
the LRU order of free cached blocks; and the simulated KV *content* of every block (what
token the "engine" wrote in each slot), so a prefix hit is checked to hand back blocks that
really hold the sequence's tokens.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.core.kv_cache_manager import KVCacheManager as _KVCacheManager


class KVCacheManager(_KVCacheManager):
    """Registers full blocks right after each successful allocation, as the scheduler does
    at the end of every step for the sequences it keeps scheduled."""

    def allocate_slots(self, seq_id, token_ids, num_computed_tokens, num_new_tokens, cached_prefix=()):
        copies = super().allocate_slots(
            seq_id, token_ids, num_computed_tokens, num_new_tokens, cached_prefix
        )
        if copies is not None:
            self.cache_full_blocks(seq_id, token_ids, num_computed_tokens + num_new_tokens)
        return copies


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(mgr: KVCacheManager):
    pool = mgr.pool
    return (
        {sid: [b.block_id for b in t] for sid, t in mgr.block_tables.items()},
        {sid: list(h) for sid, h in mgr._block_hashes.items()},
        [(b.ref_count, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool._uncached_free],
        list(pool._evictable),
        {h: b.block_id for h, b in pool._cached.items()},
        pool.num_free_blocks,
    )


def fill(mgr: KVCacheManager, seq_id: str, tokens: list[int], chunk: int | None = None):
    """Allocate slots for all of `tokens` (in chunks), as the engine would over steps."""
    done = 0
    chunk = chunk or len(tokens)
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert mgr.allocate_slots(seq_id, tokens, done, n) == []
        done += n


# -- deterministic examples --------------------------------------------------------------


def test_table_covers_ceil_tokens_over_block_size():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    tokens = list(range(11))
    for end in range(1, 12):
        assert mgr.allocate_slots("a", tokens, end - 1, 1) == []
        assert len(mgr.block_ids("a")) == cdiv(end, 4)
    assert mgr.num_free_blocks == 10 - 3
    mgr.free("a")
    assert mgr.num_free_blocks == 10
    assert mgr.block_ids("a") == []
    mgr.free("a")  # freeing twice is a no-op


def test_trim_returns_the_tail_blocks_and_its_delta_says_so():
    """A speculative step's blocks past the accepted tokens go back (KVCacheManager.trim),
    and the runner's next delta drops them before the new ones."""
    # Drafts are never registered as cached, so no automatic caching here.
    mgr = _KVCacheManager(num_blocks=10, block_size=4)
    assert mgr.allocate_slots("a", list(range(14)), 0, 14) == []  # 4 blocks
    assert mgr.take_block_delta("a", whole=True) == (0, mgr.block_ids("a"))
    kept = mgr.block_ids("a")[:2]
    mgr.trim("a", 7)
    assert mgr.block_ids("a") == kept
    assert mgr.num_free_blocks == 8
    assert mgr.allocate_slots("a", list(range(9)), 7, 2) == []  # grows again from there
    assert mgr.block_ids("a")[:2] == kept and len(mgr.block_ids("a")) == 3
    assert mgr.take_block_delta("a") == (2, mgr.block_ids("a")[2:])
    assert mgr.take_block_delta("a") == (3, [])


def test_allocate_slots_none_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    fill(mgr, "a", [1, 2, 3, 4])
    a_ids = mgr.block_ids("a")
    mgr.free("a")  # two cached evictable blocks
    fill(mgr, "b", [9])
    before = snapshot(mgr)
    # Needs 3 blocks from scratch; only 2 free (both cached).
    assert mgr.allocate_slots("c", [5, 6, 7, 8, 9], 0, 5) is None
    assert snapshot(mgr) == before
    # Adopting the two cached blocks also needs them off the free list: 2 + 1 new > 2.
    hits = mgr.find_cached_prefix([1, 2, 3, 4, 5])
    assert [b.block_id for b in hits] == a_ids
    assert mgr.allocate_slots("c", [1, 2, 3, 4, 5], 4, 1, hits) is None
    assert snapshot(mgr) == before
    # Growing an existing table by more than is free.
    assert mgr.allocate_slots("b", [9] + [0] * 6, 1, 6) is None
    assert snapshot(mgr) == before


def test_fork_and_copy_on_write_of_partial_block():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]  # one full block, one half-filled block
    fill(mgr, "p", prompt)
    parent_ids = mgr.block_ids("p")
    assert len(parent_ids) == 2
    mgr.fork("p", "c")
    assert mgr.block_ids("c") == parent_ids
    assert [mgr.pool.blocks[i].ref_count for i in parent_ids] == [2, 2]
    free_before = mgr.num_free_blocks

    copies = mgr.allocate_slots("c", prompt + [7], 6, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent_ids[1]
    assert dst not in parent_ids
    assert mgr.block_ids("c") == [parent_ids[0], dst]  # the full block stays shared
    assert mgr.block_ids("p") == parent_ids  # the other holder keeps the original
    assert mgr.pool.blocks[parent_ids[0]].ref_count == 2
    assert mgr.pool.blocks[parent_ids[1]].ref_count == 1
    assert mgr.pool.blocks[dst].ref_count == 1
    assert mgr.num_free_blocks == free_before - 1

    # The parent is now the only holder: it writes in place.
    assert mgr.allocate_slots("p", prompt + [8], 6, 1) == []
    assert mgr.block_ids("p") == parent_ids
    # The child writes again into its private block: no copy either.
    assert mgr.allocate_slots("c", prompt + [7, 9], 7, 1) == []


def test_fork_at_block_boundary_never_copies():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    fill(mgr, "p", prompt)
    mgr.fork("p", "c")
    shared = mgr.block_ids("p")
    assert mgr.allocate_slots("c", prompt + [1], 8, 1) == []
    assert mgr.allocate_slots("p", prompt + [2], 8, 1) == []
    assert mgr.block_ids("c")[:2] == shared == mgr.block_ids("p")[:2]
    assert mgr.block_ids("c")[2] != mgr.block_ids("p")[2]
    assert [mgr.pool.blocks[i].ref_count for i in shared] == [2, 2]


def test_copy_on_write_needs_a_free_block():
    mgr = KVCacheManager(num_blocks=2, block_size=4)
    fill(mgr, "p", [1, 2, 3, 4, 5])
    mgr.fork("p", "c")
    assert mgr.num_free_blocks == 0
    before = snapshot(mgr)
    assert mgr.allocate_slots("c", [1, 2, 3, 4, 5, 6], 5, 1) is None
    assert snapshot(mgr) == before


def test_prefix_cache_hit_after_free():
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs)
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    fill(mgr, "a", tokens, chunk=3)
    ids = mgr.block_ids("a")
    mgr.free("a")
    assert mgr.pool.num_cached_evictable_blocks == 3  # the partial block is not cached

    # Same tokens: (14 - 1) // 4 = 3 blocks.
    assert [b.block_id for b in mgr.find_cached_prefix(tokens)] == ids[:3]
    # Exactly 12 tokens: one must be left to compute, so only 2 blocks.
    assert [b.block_id for b in mgr.find_cached_prefix(tokens[:12])] == ids[:2]
    assert [b.block_id for b in mgr.find_cached_prefix(tokens[:13])] == ids[:3]
    # Longer sequence with the same start.
    assert [b.block_id for b in mgr.find_cached_prefix(tokens[:12] + [1] * 9)] == ids[:3]
    # Diverging inside block 2.
    assert [b.block_id for b in mgr.find_cached_prefix(tokens[:9] + [0] * 5)] == ids[:2]
    # A different first block: nothing, even though later blocks match.
    assert mgr.find_cached_prefix([0] + tokens[1:]) == []
    # Chained hashing: block 1's tokens at position 0, or after another prefix, miss.
    assert mgr.find_cached_prefix(tokens[4:]) == []
    assert mgr.find_cached_prefix([7, 7, 7, 7] + tokens[4:]) == []

    # Adopting the hit revives the cached blocks and shares them.
    hits = mgr.find_cached_prefix(tokens)
    copies = mgr.allocate_slots("b", tokens, 12, 2, hits)
    assert copies == []
    assert mgr.block_ids("b")[:3] == ids[:3]
    assert len(mgr.block_ids("b")) == 4
    assert mgr.pool.num_cached_evictable_blocks == 0
    hits2 = mgr.find_cached_prefix(tokens)
    assert mgr.allocate_slots("c", tokens, 12, 2, hits2) == []
    assert [mgr.pool.blocks[i].ref_count for i in ids[:3]] == [2, 2, 2]
    assert mgr.num_free_blocks == 16 - 5


def test_prefix_caching_disabled():
    mgr = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    fill(mgr, "a", [1, 2, 3, 4, 5])
    mgr.free("a")
    assert mgr.find_cached_prefix([1, 2, 3, 4, 5]) == []
    assert mgr.pool.num_cached_evictable_blocks == 0
    assert mgr.num_free_blocks == 8


def test_cached_blocks_evicted_lru_only_when_nothing_else_free():
    bs = 2
    mgr = KVCacheManager(num_blocks=6, block_size=bs)
    fill(mgr, "old", [1, 1, 2, 2])  # freed first
    fill(mgr, "new", [3, 3, 4, 4])  # freed second
    old_ids, new_ids = mgr.block_ids("old"), mgr.block_ids("new")
    mgr.free("old")
    mgr.free("new")
    assert mgr.pool.num_cached_evictable_blocks == 4
    # Two uncached blocks remain: used first, nothing evicted.
    fill(mgr, "x", [9, 9, 9, 9])
    assert set(mgr.block_ids("x")).isdisjoint(old_ids + new_ids)
    assert len(mgr.find_cached_prefix([1, 1, 2, 2, 0])) == 2
    assert len(mgr.find_cached_prefix([3, 3, 4, 4, 0])) == 2
    # Next block evicts the least recently freed: "old"'s tail block (tail freed first).
    fill(mgr, "y", [8, 8])
    assert mgr.block_ids("y") == [old_ids[1]]
    assert [b.block_id for b in mgr.find_cached_prefix([1, 1, 2, 2, 0])] == old_ids[:1]
    assert len(mgr.find_cached_prefix([3, 3, 4, 4, 0])) == 2
    fill(mgr, "z", [7, 7])
    assert mgr.block_ids("z") == [old_ids[0]]
    assert mgr.find_cached_prefix([1, 1, 2, 2, 0]) == []
    fill(mgr, "w", [6, 6])
    assert mgr.block_ids("w") == [new_ids[1]]


# -- stateful model ----------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=10)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None

    @initialize(num_blocks=st.integers(1, 14), bs=st.integers(1, 4), caching=st.booleans())
    def init(self, num_blocks, bs, caching):
        self.mgr = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching)
        self.n, self.bs, self.caching = num_blocks, bs, caching
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.runner_tables: dict[str, list[int]] = {}  # rebuilt from take_block_delta alone
        self.nhashed: dict[str, int] = {}
        self.key_of: dict[int, tuple] = {}  # block id -> full token prefix it caches
        self.cache: dict[tuple, int] = {}
        self.evict_order: list[int] = []
        self.uncached: set[int] = set(range(num_blocks))
        self.content: dict[int, list] = {i: [None] * bs for i in range(num_blocks)}
        self.next_id = 0

    # -- model helpers ---------------------------------------------------------------------

    def ref(self, bid: int) -> int:
        return sum(t.count(bid) for t in self.tables.values())

    def free_count(self) -> int:
        return len(self.uncached) + len(self.evict_order)

    def expected_prefix(self, tokens: list[int]) -> list[int]:
        if not self.caching:
            return []
        hits = []
        for i in range((len(tokens) - 1) // self.bs):
            key = tuple(tokens[: (i + 1) * self.bs])
            if key not in self.cache:
                break
            hits.append(self.cache[key])
        return hits

    def model_allocate(self, bid: int) -> None:
        if self.uncached:
            assert bid in self.uncached, "evicted a cached block while uncached ones were free"
            self.uncached.remove(bid)
        else:
            assert self.evict_order and bid == self.evict_order[0], "eviction is not LRU"
            self.evict_order.pop(0)
            del self.cache[self.key_of.pop(bid)]
            event("evicted a cached block")
        self.content[bid] = [None] * self.bs

    def release_table(self, table: list[int]) -> None:
        for bid in reversed(table):
            if self.ref(bid) == 0:
                if bid in self.key_of:
                    self.evict_order.append(bid)
                else:
                    self.uncached.add(bid)

    def do_allocate(self, sid, num_computed, num_new, hits):
        """Call allocate_slots and check it against the model; returns True on success."""
        tokens = self.tokens[sid]
        end = num_computed + num_new
        is_new = sid not in self.tables
        table = list(hits) if is_new else self.tables[sid]
        new_blocks = max(0, cdiv(end, self.bs) - len(table))
        fwb = num_computed // self.bs
        needs_copy = (not is_new and num_new > 0 and fwb < len(table) and self.ref(table[fwb]) > 1)
        revived = sum(1 for b in hits if self.ref(b) == 0) if is_new else 0
        before = snapshot(self.mgr)
        result = self.mgr.allocate_slots(
            sid, tokens, num_computed, num_new,
            [self.mgr.pool.blocks[b] for b in hits] if is_new else (),
        )
        if new_blocks + needs_copy + revived > self.free_count():
            assert result is None
            assert snapshot(self.mgr) == before
            event("allocate_slots -> None")
            return False
        assert result is not None
        got = self.mgr.block_ids(sid)
        assert len(got) == cdiv(end, self.bs) if end > 0 else len(got) == len(table)
        if is_new:
            assert got[: len(hits)] == list(hits)
            for b in hits:
                if b in self.evict_order:
                    self.evict_order.remove(b)
            self.nhashed[sid] = len(hits)
        else:
            assert got[: fwb] == table[: fwb]
            assert got[fwb + 1: len(table)] == table[fwb + 1:]
        if needs_copy:
            src, dst = table[fwb], got[fwb]
            assert result == [(src, dst)]
            assert dst != src
            event("copy-on-write")
            self.model_allocate(dst)
            self.content[dst] = list(self.content[src])
        else:
            assert result == []
            assert got[: len(table)] == table
        for bid in got[len(table):]:
            self.model_allocate(bid)
        self.tables[sid] = got
        # The "engine" computes the step: write each new token into its slot.
        for pos in range(num_computed, end):
            self.content[got[pos // self.bs]][pos % self.bs] = tokens[pos]
        self.computed[sid] = end
        # Full blocks become findable by their whole token prefix (first writer wins).
        num_full = min(end, len(tokens)) // self.bs
        for i in range(self.nhashed[sid], num_full):
            key = tuple(tokens[: (i + 1) * self.bs])
            bid = got[i]
            if self.caching and bid not in self.key_of and key not in self.cache:
                self.key_of[bid] = key
                self.cache[key] = bid
        self.nhashed[sid] = max(self.nhashed[sid], num_full)
        return True

    # -- rules -----------------------------------------------------------------------------

    @rule(tokens=TOKENS, use_prefix=st.booleans(), data=st.data())
    def new_seq(self, tokens, use_prefix, data):
        sid = f"s{self.next_id}"
        self.next_id += 1
        hits: list[int] = []
        if use_prefix:
            hits = [b.block_id for b in self.mgr.find_cached_prefix(tokens)]
            assert hits == self.expected_prefix(tokens)
            event(f"prefix hit: {bool(hits)}")
            assert len(hits) <= (len(tokens) - 1) // self.bs
            for i, bid in enumerate(hits):  # a hit really holds these tokens
                assert self.content[bid] == tokens[i * self.bs: (i + 1) * self.bs]
        num_computed = len(hits) * self.bs
        num_new = data.draw(st.integers(1, len(tokens) - num_computed))
        self.tokens[sid] = list(tokens)
        if not self.do_allocate(sid, num_computed, num_new, hits):
            del self.tokens[sid]

    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), max_size=5))
    def grow(self, data, extra, sid=None):
        if not self.tables:
            return
        if sid is None:
            sid = data.draw(st.sampled_from(sorted(self.tables)))
        tokens = self.tokens[sid]
        tokens.extend(extra)
        if len(tokens) == self.computed[sid]:
            tokens.append(data.draw(st.integers(0, 1)))
        num_new = data.draw(st.integers(1, len(tokens) - self.computed[sid]))
        self.do_allocate(sid, self.computed[sid], num_new, [])

    @rule(data=st.data(), then_write=st.sampled_from([None, "parent", "child"]))
    def fork(self, data, then_write):
        if not self.tables:
            return
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent][: self.computed[parent]])
        self.computed[child] = self.computed[parent]
        self.nhashed[child] = self.nhashed[parent]
        assert self.mgr.block_ids(child) == self.tables[parent]
        if then_write is not None:
            extra = data.draw(st.lists(st.integers(0, 1), max_size=3))
            self.grow(data, extra, sid=parent if then_write == "parent" else child)

    @rule(data=st.data())
    def free(self, data):
        if not self.tables:
            self.mgr.free("nobody")
            return
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        self.mgr.free(sid)
        table = self.tables.pop(sid)
        self.runner_tables.pop(sid, None)  # the runner forgets a finished sequence
        del self.tokens[sid], self.computed[sid], self.nhashed[sid]
        self.release_table(table)
        assert self.mgr.block_ids(sid) == []

    @rule(tokens=TOKENS)
    def lookup(self, tokens):
        got = [b.block_id for b in self.mgr.find_cached_prefix(tokens)]
        assert got == self.expected_prefix(tokens)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        if self.mgr is None:
            return
        mgr, pool = self.mgr, self.mgr.pool
        assert {sid: mgr.block_ids(sid) for sid in mgr.block_tables} == self.tables
        # A runner's copy of each table, kept only from the deltas, equals the table.
        for sid, blocks in mgr.block_tables.items():
            copy = self.runner_tables.get(sid)
            num_kept, new_ids = mgr.take_block_delta(sid, whole=copy is None)
            copy = (copy or [])[:num_kept] + new_ids
            self.runner_tables[sid] = copy
            assert copy == [b.block_id for b in blocks]
        held = Counter(b for t in self.tables.values() for b in t)
        for block in pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
        in_use = len(held)
        assert len(self.uncached) + len(self.evict_order) + in_use == self.n
        assert mgr.num_free_blocks == self.n - in_use == self.free_count()
        assert pool.num_cached_evictable_blocks == len(self.evict_order)
        assert list(pool._evictable) == self.evict_order
        for sid, table in self.tables.items():
            assert len(table) == cdiv(self.computed[sid], self.bs)
            for pos in range(self.computed[sid]):  # the KV a sequence reads is its own
                assert self.content[table[pos // self.bs]][pos % self.bs] == self.tokens[sid][pos]
        for key, bid in self.cache.items():
            assert self.content[bid] == list(key[-self.bs:])
            assert pool.blocks[bid].block_hash is not None


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
