"""Iteration-level scheduling: every step decides which sequences run and how many tokens each.

The decision is plain data ({sequence id: number of tokens}), so a decode (1 token), a
prefill chunk and a prompt whose prefix was cached are all the same case.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import BlockCopy, KVCacheManager
from kvserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled_seqs: list[Sequence] = field(default_factory=list)  # in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted_seqs: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_seqs


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------

    def _queue_key(self, seq: Sequence) -> tuple:
        if self.config.policy == "priority":
            return (seq.priority, seq.arrival_time)
        return (seq.arrival_time,)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence by policy order; a preempted one goes back ahead of later arrivals."""
        seq.status = SequenceStatus.WAITING
        bisect.insort_right(self.waiting, seq, key=self._queue_key)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """A sample forked from a running parent runs right after it."""
        self.kv_cache.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self.kv_cache.free(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step decision -----------------------------------------------------------------

    def _pick_victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=self._queue_key)
        return self.running[-1]  # the latest admitted

    def _preempt(self, seq: Sequence, out: SchedulerOutput, copies: dict[str, list]) -> int:
        """Returns the tokens it had been given this step (the priority victim may have some)."""
        self.running.remove(seq)
        self.kv_cache.free(seq.seq_id)
        returned_budget = out.num_scheduled_tokens.pop(seq.seq_id, 0)
        if returned_budget:
            out.scheduled_seqs.remove(seq)
            copies.pop(seq.seq_id, None)
        seq.reset_for_recompute()
        self.add(seq)
        out.preempted_seqs.append(seq)
        self.num_preemptions += 1
        return returned_budget

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        copies: dict[str, list[BlockCopy]] = {}
        budget = self.config.max_num_batched_tokens

        # Running sequences first: decodes and prefills already under way.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new == 1:  # a decode: its drafts (if any) are verified in the same pass
                num_new += len(seq.spec_token_ids)
            num_new = min(num_new, budget)
            while True:
                seq_copies = self.kv_cache.allocate_slots(
                    seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, num_new
                )
                if seq_copies is not None:
                    break
                victim = self._pick_victim()
                budget += self._preempt(victim, out, copies)
                if victim is seq:
                    break
            if seq_copies is None:
                continue
            # Drafts the budget cut off (or that a prefill chunk cannot carry) are dropped.
            num_drafts = max(0, seq.num_computed_tokens + num_new - seq.num_tokens)
            if num_drafts < len(seq.spec_token_ids):
                seq.spec_token_ids = seq.spec_token_ids[:num_drafts]
            copies[seq.seq_id] = seq_copies
            out.scheduled_seqs.append(seq)
            out.num_scheduled_tokens[seq.seq_id] = num_new
            budget -= num_new

        # Then admit waiting sequences while blocks, budget and the sequence limit allow.
        # After a preemption memory is short: admitting now would only thrash.
        while (
            self.waiting
            and not out.preempted_seqs
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            # Prompt logprobs need every prompt position computed, so no prefix hits then.
            cached_prefix = (
                [] if seq.wants_prompt_logprobs
                else self.kv_cache.find_cached_prefix(seq.all_token_ids)
            )
            num_computed = len(cached_prefix) * self.kv_cache.block_size
            num_new = seq.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            seq_copies = self.kv_cache.allocate_slots(
                seq.seq_id, seq.all_token_ids, num_computed, num_new, cached_prefix
            )
            if seq_copies is None:
                break
            self.waiting.pop(0)
            self.prefix_cache_stats.queried_tokens += seq.num_tokens
            self.prefix_cache_stats.hit_tokens += num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            copies[seq.seq_id] = seq_copies
            out.scheduled_seqs.append(seq)
            out.num_scheduled_tokens[seq.seq_id] = num_new
            budget -= num_new

        for seq in out.scheduled_seqs:
            out.block_copies.extend(copies[seq.seq_id])
            # all_token_ids holds verified tokens only, so no block holding a draft's KV
            # is ever registered in the prefix cache.
            self.kv_cache.cache_full_blocks(
                seq.seq_id, seq.all_token_ids,
                seq.num_computed_tokens + out.num_scheduled_tokens[seq.seq_id],
            )
        return out
