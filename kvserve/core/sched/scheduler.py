"""Iteration-level scheduling: every step decides which sequences run and how many tokens each.

The decision is plain data ({sequence id: number of tokens}, see output.py), so a decode
(1 token), a prefill chunk and a prompt whose prefix was cached are all the same case. The
scheduler owns the KV blocks' accounting: it allocates, registers full blocks in the prefix
cache, and gives back the blocks of rejected drafts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import BlockCopy, KVCacheManager
from kvserve.core.sched.output import SchedulerOutput
from kvserve.core.sched.step_builder import StepBuilder
from kvserve.core.sequence import Sequence, SequenceStatus


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
        self.seqs: dict[str, Sequence] = {}  # every sequence waiting or running, by id
        self.step_builder = StepBuilder(kv_cache)
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
        self.seqs[seq.seq_id] = seq
        bisect.insort_right(self.waiting, seq, key=self._queue_key)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """A sample forked from a running parent runs right after it."""
        self.kv_cache.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        self.seqs[child.seq_id] = child
        self.running.insert(self.running.index(parent) + 1, child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self.seqs.pop(seq.seq_id, None)
        self.kv_cache.free(seq.seq_id)
        self.step_builder.drop(seq.seq_id)

    def scheduled(self, out: SchedulerOutput) -> list[Sequence]:
        """The sequences a step runs, in batch order."""
        return [self.seqs[seq_id] for seq_id in out.num_scheduled_tokens]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step decision -----------------------------------------------------------------

    def _pick_victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=self._queue_key)
        return self.running[-1]  # the latest admitted

    def _preempt(
        self,
        seq: Sequence,
        scheduled: dict[Sequence, int],
        copies: dict[str, list[BlockCopy]],
        preempted: list[Sequence],
    ) -> int:
        """Returns the tokens it had been given this step (the priority victim may have some)."""
        self.running.remove(seq)
        self.kv_cache.free(seq.seq_id)
        self.step_builder.resend(seq.seq_id)
        returned_budget = scheduled.pop(seq, 0)
        copies.pop(seq.seq_id, None)
        seq.reset_for_recompute()
        self.add(seq)
        preempted.append(seq)
        self.num_preemptions += 1
        return returned_budget

    def schedule(self) -> SchedulerOutput:
        scheduled: dict[Sequence, int] = {}  # in batch order
        copies: dict[str, list[BlockCopy]] = {}
        preempted: list[Sequence] = []
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
                budget += self._preempt(victim, scheduled, copies, preempted)
                if victim is seq:
                    break
            if seq_copies is None:
                continue
            # Drafts the budget cut off (or that a prefill chunk cannot carry) are dropped.
            num_drafts = max(0, seq.num_computed_tokens + num_new - seq.num_tokens)
            if num_drafts < len(seq.spec_token_ids):
                seq.spec_token_ids = seq.spec_token_ids[:num_drafts]
            copies[seq.seq_id] = seq_copies
            scheduled[seq] = num_new
            budget -= num_new

        # Then admit waiting sequences while blocks, budget and the sequence limit allow.
        # After a preemption memory is short: admitting now would only thrash.
        while (
            self.waiting
            and not preempted
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
            scheduled[seq] = num_new
            budget -= num_new

        out = SchedulerOutput(
            finished_seq_ids=self.step_builder.take_dropped(),
            preempted_seq_ids=[seq.seq_id for seq in preempted],
        )
        for seq, num_new in scheduled.items():
            out.block_copies.extend(copies[seq.seq_id])
            # all_token_ids holds verified tokens only, so no block holding a draft's KV
            # is ever registered in the prefix cache.
            self.kv_cache.cache_full_blocks(
                seq.seq_id, seq.all_token_ids, seq.num_computed_tokens + num_new
            )
            self.add_to_step(out, seq, num_new)
        return out

    def add_to_step(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        self.step_builder.add(
            out, seq.seq_id, seq.all_token_ids, seq.num_prompt_tokens, seq.num_computed_tokens,
            num_new, seq.wants_prompt_logprobs and seq.index == 0,
        )
        if seq.spec_token_ids:
            out.spec_token_ids[seq.seq_id] = seq.spec_token_ids
            if seq.spec_tree_parents is not None:
                out.spec_tree_parents[seq.seq_id] = seq.spec_tree_parents

    def schedule_ahead(self, seqs: list[Sequence]) -> SchedulerOutput | None:
        """The next decode step of sequences whose newest token is still on the device
        (overlapped scheduling: the step is launched before the host reads it). None when
        it must wait for the host: requests waiting for admission (admitted in a step of
        their own) or too few free blocks (preemption happens in a step of its own)."""
        if self.waiting:
            return None
        copies: list[BlockCopy] = []
        for seq in seqs:
            # Blocks taken here before a failure are the ones the next step needs anyway.
            # The in-flight token counts as known: its slot is the one being written.
            seq_copies = self.kv_cache.allocate_slots(
                seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, 1
            )
            if seq_copies is None:
                return None
            copies += seq_copies
        out = SchedulerOutput(finished_seq_ids=self.step_builder.take_dropped(), block_copies=copies)
        for seq in seqs:
            self.add_to_step(out, seq, 1)
        return out

    def advance(self, out: SchedulerOutput, seqs: list[Sequence]) -> None:
        """After the step ran: the scheduled tokens are computed. Drafts' KV is written but
        counts only once they are accepted (accept_drafts)."""
        for seq in seqs:
            seq.num_computed_tokens += out.num_scheduled_tokens[seq.seq_id] - len(
                out.spec_token_ids.get(seq.seq_id, ())
            )

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """A verify step accepted `num_accepted` of the sequence's drafts: their KV is valid."""
        seq.num_computed_tokens += num_accepted
        seq.clear_drafts()

    def release_rejected_drafts(self, seq: Sequence) -> None:
        """Give back the blocks that only held the sequence's rejected drafts."""
        self.kv_cache.trim(seq.seq_id, seq.num_computed_tokens)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks once the tokens in them are known (after an
        overlapped step's token is read; the step writing its KV is already queued)."""
        self.kv_cache.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
