"""Block tables per sequence on top of the block pool: prefix hits, growth, forks, copy-on-write."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.multimodal.inputs import ImageFeature, image_hashes_in

BlockCopy = tuple[int, int]  # (source block id, destination block id)


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int],
                      image_hashes: tuple[str, ...] = ()) -> int:
    """Chained hash: a block is identified by its tokens and by everything before it, and
    by the images whose placeholder tokens it holds (equal placeholder ids, other pixels)."""
    if image_hashes:
        return hash((parent_hash, tuple(token_ids), image_hashes))
    return hash((parent_hash, tuple(token_ids)))


def root_hash(lora_int_id: int) -> int | None:
    """The parent of a sequence's first block: the LoRA adapter it runs with (None: the base
    model), so that KV computed under one adapter is never found by another or by the base."""
    return hash(("lora", lora_int_id)) if lora_int_id else None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # Each table's block ids as C ints, kept in step with it: the deltas a step sends
        # the runner are slices of it (take_block_delta).
        self._block_ids: dict[str, array] = {}
        # Hashes of each sequence's full blocks, in order (a prefix of its block table).
        self._block_hashes: dict[str, list[int]] = {}
        # Leading block ids of each table that the model runner holds unchanged: a step
        # sends it only the rest (take_block_delta).
        self._num_synced_blocks: dict[str, int] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_unused_slots(self, num_computed_tokens: Mapping[str, int]) -> int:
        """Slots of in-use blocks that hold no token (internal fragmentation): those past each
        table's computed tokens, once per block (a fork shares its parent's partial block)."""
        filled: dict[int, int] = {}
        for seq_id, computed in num_computed_tokens.items():
            table = self.block_tables.get(seq_id, ())
            for index in range(computed // self.block_size, len(table)):
                tokens = max(0, min(self.block_size, computed - index * self.block_size))
                block_id = table[index].block_id
                filled[block_id] = max(filled.get(block_id, 0), tokens)
        return sum(self.block_size - tokens for tokens in filled.values())

    def block_ids(self, seq_id: str) -> list[int]:
        return self._block_ids.get(seq_id, array("i")).tolist()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_block_delta(self, seq_id: str, whole: bool = False) -> tuple[int, list[int]]:
        """(blocks the runner keeps, ids that follow them) to bring the runner's copy of the
        table up to date, which it now is; `whole`: the runner holds none of it."""
        ids = self._block_ids[seq_id]
        num_kept = 0 if whole else self._num_synced_blocks[seq_id]
        self._num_synced_blocks[seq_id] = len(ids)
        return num_kept, ids[num_kept:].tolist()

    # -- prefix cache ----------------------------------------------------------------------

    def _block_hash(self, parent: int | None, token_ids: Sequence[int], index: int,
                    images: Sequence[ImageFeature]) -> int:
        start, end = index * self.block_size, (index + 1) * self.block_size
        return hash_block_tokens(parent, token_ids[start:end], image_hashes_in(images, start, end))

    def find_cached_prefix(self, token_ids: Sequence[int], images: Sequence[ImageFeature] = (),
                           lora_int_id: int = 0) -> list[KVBlock]:
        """Cached blocks covering the longest cached prefix of `token_ids` (with its
        `images`) computed with the same LoRA adapter (0: the base model).

        At least one token is always left to compute, since the step must produce logits
        for the last position.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = root_hash(lora_int_id)
        for i in range(max_blocks):
            parent = self._block_hash(parent, token_ids, i, images)
            block = self.pool.lookup(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- growth ----------------------------------------------------------------------------

    def allocate_slots(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_prefix: Sequence[KVBlock] = (),
    ) -> list[BlockCopy] | None:
        """Make room to compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).

        `token_ids` are all of the sequence's known tokens. `cached_prefix` (only for a
        sequence that has no table yet) are prefix-cache hits to adopt; `num_computed_tokens`
        already counts them. Returns the block copies that copy-on-write needs before the
        step runs, or None (changing nothing) when the pool has too few free blocks.
        """
        table = self.block_tables.get(seq_id)
        adopted = list(cached_prefix) if table is None else []
        num_table_blocks = len(adopted) if table is None else len(table)
        end = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_needed(end) - num_table_blocks)
        first_write_block = num_computed_tokens // self.block_size
        needs_copy = (
            table is not None
            and num_new_tokens > 0
            and first_write_block < len(table)
            and table[first_write_block].ref_count > 1
        )
        # Adopting a cached block that nobody holds takes it off the free list too.
        num_revived = sum(1 for block in adopted if block.ref_count == 0)
        if num_new_blocks + needs_copy + num_revived > self.pool.num_free_blocks:
            return None

        if table is None:
            for block in adopted:
                self.pool.acquire(block)
            table = self.block_tables[seq_id] = adopted
            self._block_ids[seq_id] = array("i", [block.block_id for block in adopted])
            self._block_hashes[seq_id] = [block.block_hash for block in adopted]
            self._num_synced_blocks[seq_id] = 0

        ids = self._block_ids[seq_id]
        copies: list[BlockCopy] = []
        if needs_copy:
            shared = table[first_write_block]
            private = self.pool.allocate()
            self.pool.release(shared)
            table[first_write_block] = private
            ids[first_write_block] = private.block_id
            copies.append((shared.block_id, private.block_id))
            self._num_synced_blocks[seq_id] = min(self._num_synced_blocks[seq_id], first_write_block)
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate())
            ids.append(table[-1].block_id)
        return copies

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                          images: Sequence[ImageFeature] = (), lora_int_id: int = 0) -> None:
        """Make the sequence's blocks that are full once `num_tokens` are computed findable
        (by sequences of the same LoRA adapter, `lora_int_id`; 0: the base model).

        Called when the step that writes those tokens is certain to run (not for a sequence
        preempted before it), so a hit never reads KV that was not written.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._block_hashes[seq_id]
        table = self.block_tables[seq_id]
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(lora_int_id)
            block_hash = self._block_hash(parent, token_ids, i, images)
            hashes.append(block_hash)
            self.pool.register(table[i], block_hash)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens: a speculative
        step's blocks that only held rejected drafts go back to the pool."""
        table = self.block_tables[seq_id]
        keep = self.num_blocks_needed(num_tokens)
        if len(self._block_hashes[seq_id]) > keep:
            raise RuntimeError(f"{seq_id}: trimming would drop a block registered as cached")
        ids = self._block_ids[seq_id]
        while len(table) > keep:
            self.pool.release(table.pop())
            ids.pop()
        self._num_synced_blocks[seq_id] = min(self._num_synced_blocks[seq_id], keep)

    # -- sharing and release ---------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; writes later copy on demand."""
        table = self.block_tables[parent_id]
        for block in table:
            self.pool.acquire(block)
        self.block_tables[child_id] = list(table)
        self._block_ids[child_id] = array("i", self._block_ids[parent_id])
        self._block_hashes[child_id] = list(self._block_hashes[parent_id])
        self._num_synced_blocks[child_id] = 0

    def free(self, seq_id: str) -> None:
        table = self.block_tables.pop(seq_id, None)
        self._block_ids.pop(seq_id, None)
        self._block_hashes.pop(seq_id, None)
        self._num_synced_blocks.pop(seq_id, None)
        if table is None:
            return
        # Tail first, so the prefix blocks are the last to be evicted.
        for block in reversed(table):
            self.pool.release(block)
