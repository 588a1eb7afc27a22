"""Iteration-level scheduling: every step decides which sequences run and how many tokens each.

The decision is plain data ({sequence id: number of tokens}, see output.py), so a decode
(1 token), a prefill chunk and a prompt whose prefix was cached are all the same case. The
scheduler owns the KV blocks' accounting: it allocates, registers full blocks in the prefix
cache, and gives back the blocks of rejected drafts.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from collections.abc import Set
from dataclasses import dataclass

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import BlockCopy, KVCacheManager
from kvserve.core.sched.canonical_chunks import CanonicalChunks, canonical_chunk_size
from kvserve.core.sched.output import ModelRunnerOutput, SampledSequence, SchedulerOutput
from kvserve.core.sched.encoder_budget import EncoderBudget
from kvserve.core.sched.encoder_slicer import EncoderSlicer
from kvserve.core.sched.step_builder import StepBuilder
from kvserve.core.sequence import Sequence, SequenceStatus, check_stop


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class SequenceUpdate:
    """Tokens a step appended to a sequence (a verified run stops at a token that ends it)."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    num_drafts: int = 0  # drafts verified, and accepted
    num_accepted: int = 0


def num_seq_slots_held(seq: Sequence) -> int:
    """Running sequences a sequence stands for: a request's n samples until its prompt
    forks into them, then one each."""
    request = seq.request
    return request.params.n if len(request.sequences) == 1 else 1


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        eos_token_ids: Seq[int] = (),
        max_model_len: int | None = None,
    ) -> None:
        """`eos_token_ids`, `max_model_len`: what ends a sequence besides its request's
        own stop tokens and max_tokens."""
        self.config = config
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every sequence waiting or running, by id
        self.step_builder = StepBuilder(kv_cache)
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_preemptions = 0
        # Batch-invariant: a prompt's pieces depend on the prompt alone, never on the budget
        # other requests leave it (canonical_chunks.py).
        self.canonical: CanonicalChunks | None = None
        if config.batch_invariant:
            size = (canonical_chunk_size(config.max_num_batched_tokens, config.max_num_seqs, kv_cache.block_size)
                    if config.enable_chunked_prefill else None)
            self.canonical = CanonicalChunks(size, kv_cache.block_size)
        self.encoder_slicer = None if config.encoder_slicing is None else EncoderSlicer(
            config.encoder_slicing, config.max_num_batched_tokens)

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

    def _fork(self, out: SchedulerOutput, seq: Sequence) -> None:
        """A prompt that this step finishes forks into its request's n samples: they share
        its blocks, run right after it, and sample their first tokens from its logits."""
        previous = seq
        for index in range(1, seq.request.params.n):
            child = seq.fork(index)
            child.num_computed_tokens = seq.num_tokens  # the prompt, once this step ran
            self.kv_cache.fork(seq.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            self.seqs[child.seq_id] = child
            self.running.insert(self.running.index(previous) + 1, child)
            out.forks.setdefault(seq.seq_id, []).append((child.seq_id, index))
            previous = child

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
        if self.encoder_slicer is not None:
            self.encoder_slicer.release(seq.seq_id)

    def scheduled(self, out: SchedulerOutput) -> list[Sequence]:
        """The sequences a step runs, in batch order."""
        return [self.seqs[seq_id] for seq_id in out.num_scheduled_tokens]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) requests: running with any sample running, else waiting."""
        running = {seq.request.request_id for seq in self.running}
        waiting = {seq.request.request_id for seq in self.waiting} - running
        return len(running), len(waiting)

    def lora_requests(self) -> dict[str, tuple[int, int]]:
        """LoRA adapter name -> (running, waiting) requests on it, as num_requests counts them."""
        running = {seq.request.request_id: seq.request for seq in self.running if seq.lora_int_id}
        waiting = {seq.request.request_id: seq.request for seq in self.waiting
                   if seq.lora_int_id and seq.request.request_id not in running}
        counts: dict[str, tuple[int, int]] = {}
        for requests, column in ((running, 0), (waiting, 1)):
            for request in requests.values():
                pair = list(counts.get(request.lora_request.lora_name, (0, 0)))
                pair[column] += 1
                counts[request.lora_request.lora_name] = (pair[0], pair[1])
        return counts

    # -- the step decision -----------------------------------------------------------------

    def _last_in_order(self, seqs: list[Sequence]) -> Sequence:
        """The sequence the policy preempts first: the lowest priority, else the latest admitted."""
        if self.config.policy == "priority":
            return max(seqs, key=self._queue_key)
        return seqs[-1]

    def _pick_victim(self, seq: Sequence, in_flight: Set[str]) -> Sequence | None:
        """A running sequence to preempt so that `seq` gets blocks; never one a step in flight
        still runs (its blocks are being written, and its output would land on a sequence
        reset for recompute). None when that would be `seq` itself while one it outranks is
        in flight: `seq` then waits for that step's output and preempts that one, where two
        sequences would otherwise take turns preempting themselves and neither finish."""
        victim = self._last_in_order([s for s in self.running if s.seq_id not in in_flight])
        if victim is seq and self._last_in_order(self.running) is not seq:
            return None
        return victim

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
        if self.encoder_slicer is not None:
            self.encoder_slicer.release(seq.seq_id)
        seq.reset_for_recompute()
        self.add(seq)
        preempted.append(seq)
        self.num_preemptions += 1
        return returned_budget

    def schedule(self, in_flight: Set[str] = frozenset()) -> SchedulerOutput:
        """The next step. `in_flight`: sequences that steps still in the pipeline run
        (pipeline parallelism keeps several in flight); they are neither scheduled again
        nor preempted until their outputs are back."""
        scheduled: dict[Sequence, int] = {}  # in batch order
        copies: dict[str, list[BlockCopy]] = {}
        preempted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        encoder_budget = EncoderBudget(budget)
        slicer = self.encoder_slicer
        # A running prompt's canonical piece that did not fit the budget left: no new prompt
        # takes that budget (or blocks the piece needs) ahead of it.
        deferred = False
        # A running sequence short of blocks whose victim is still in flight.
        waits_for_blocks = False

        # Running sequences first: decodes and prefills already under way.
        for seq in list(self.running):
            if budget == 0:
                break
            # Preempted earlier in this loop, or run by a step still in the pipeline.
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in in_flight:
                continue
            num_new = seq.num_tokens - seq.num_computed_tokens
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                # A decode (and any accepted tokens whose KV is recomputed): its drafts, if
                # any, are verified in the same pass.
                num_new += len(seq.spec_token_ids)
            elif self.canonical is not None:
                num_new = self.canonical.next_piece(seq.num_computed_tokens, num_new)
                if num_new > budget:
                    deferred = True
                    continue  # a later step runs the whole piece
            num_new = min(num_new, budget)
            if seq.mm_features:
                num_new = self._fit_images(encoder_budget, seq, seq.num_computed_tokens, num_new, bool(scheduled))
                if num_new == 0:
                    continue
            while True:
                seq_copies = self.kv_cache.allocate_slots(
                    seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, num_new
                )
                if seq_copies is not None:
                    break
                victim = self._pick_victim(seq, in_flight)
                if victim is None:
                    waits_for_blocks = True
                    break
                budget += self._preempt(victim, scheduled, copies, preempted)
                if victim is seq:
                    break
            if seq_copies is None:
                continue
            # Drafts the budget cut off (or that a prefill chunk cannot carry) are dropped.
            num_drafts = max(0, seq.num_computed_tokens + num_new - seq.num_tokens)
            if num_drafts < len(seq.spec_token_ids):
                # A prefix of a tree's nodes (topological order) is a tree.
                seq.spec_token_ids = seq.spec_token_ids[:num_drafts]
                if seq.spec_tree_parents is not None:
                    seq.spec_tree_parents = seq.spec_tree_parents[:num_drafts] if num_drafts else None
            copies[seq.seq_id] = seq_copies
            scheduled[seq] = num_new
            budget -= num_new

        # Then admit waiting sequences while blocks, budget and the sequence limit allow.
        # After a preemption, or while a sequence waits for blocks, memory is short: admitting
        # now would only thrash.
        num_seq_slots = sum(num_seq_slots_held(seq) for seq in self.running)
        running_loras = {seq.lora_int_id for seq in self.running} - {0} if self.config.max_loras else set()
        index = 0
        while (index < len(self.waiting) and not preempted and not waits_for_blocks and not deferred
               and budget > 0):
            seq = self.waiting[index]
            # A prompt counts as all the samples it forks into, so the forks never take
            # the running count past max_num_seqs.
            if num_seq_slots + num_seq_slots_held(seq) > self.config.max_num_seqs:
                break
            # At most max_loras adapters run at once (the device's slots): a request for
            # another one waits, and those behind it that fit go ahead.
            lora_int_id = seq.lora_int_id
            if lora_int_id and self.config.max_loras and lora_int_id not in running_loras \
                    and len(running_loras) >= self.config.max_loras:
                index += 1
                continue
            # Prompt logprobs need every prompt position computed, so no prefix hits then.
            cached_prefix = (
                [] if seq.wants_prompt_logprobs
                else self.kv_cache.find_cached_prefix(seq.all_token_ids, seq.mm_features, lora_int_id)
            )
            if self.canonical is not None:
                cached_prefix = cached_prefix[
                    : self.canonical.usable_hit_tokens(len(cached_prefix) * self.kv_cache.block_size)
                    // self.kv_cache.block_size]
            num_computed = len(cached_prefix) * self.kv_cache.block_size
            num_new = seq.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                # Whole prompts only: one longer than the whole step budget runs alone, in a
                # step of its own (waiting for a budget it can never get would stall the queue).
                if scheduled or num_new <= self.config.max_num_batched_tokens:
                    break
            elif self.canonical is not None:
                num_new = self.canonical.next_piece(num_computed, num_new)
                if num_new > budget:
                    break  # it and those behind it wait for a step with room for its piece
            else:
                num_new = min(num_new, budget)
            if seq.mm_features:
                fitted = self._fit_images(encoder_budget, seq, num_computed, num_new, bool(scheduled))
                if fitted == 0 or (fitted < num_new and not self.config.enable_chunked_prefill):
                    break
                num_new = fitted
            seq_copies = self.kv_cache.allocate_slots(
                seq.seq_id, seq.all_token_ids, num_computed, num_new, cached_prefix
            )
            if seq_copies is None:
                break
            self.waiting.pop(index)
            if lora_int_id:
                running_loras.add(lora_int_id)
            self.prefix_cache_stats.queried_tokens += seq.num_tokens
            self.prefix_cache_stats.hit_tokens += num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_seq_slots += num_seq_slots_held(seq)
            copies[seq.seq_id] = seq_copies
            scheduled[seq] = num_new
            budget -= num_new

        out = SchedulerOutput(
            finished_seq_ids=self.step_builder.take_dropped(),
            preempted_seq_ids=[seq.seq_id for seq in preempted],
        )
        if slicer is not None:
            out.encoder_slices = slicer.take_step()
            out.encoder_cancelled = slicer.take_cancelled()
        for seq, num_new in scheduled.items():
            out.block_copies.extend(copies[seq.seq_id])
            if self.canonical is None or self.canonical.is_full_prompt_chunk(
                    seq.num_computed_tokens, num_new, seq.num_prompt_tokens):
                # all_token_ids holds verified tokens only, so no block holding a draft's KV
                # is ever registered in the prefix cache.
                self.kv_cache.cache_full_blocks(
                    seq.seq_id, seq.all_token_ids, seq.num_computed_tokens + num_new, seq.mm_features,
                    seq.lora_int_id,
                )
            self.add_to_step(out, seq, num_new)
            if (
                seq.request.params.n > 1
                and len(seq.request.sequences) == 1
                and seq.num_computed_tokens + num_new == seq.num_tokens
            ):
                self._fork(out, seq)
        return out

    def _fit_images(self, encoder_budget: EncoderBudget, seq: Sequence, start: int, num_new: int,
                    step_has_others: bool) -> int:
        """The tokens of the piece the step may compute without starting more image encoding
        than its budget allows (whole images), or up to the first image whose sliced
        encoding is not finished. A batch-invariant piece is never cut: it waits for a step
        with room, or, with whole images, runs whole when it is the first thing its step
        schedules; with sliced encoding it waits until its images are ready."""
        slicer = self.encoder_slicer
        fitted = (encoder_budget.fit(seq.mm_features, start, num_new) if slicer is None
                  else slicer.fit(seq.seq_id, seq.mm_features, start, num_new))
        if self.canonical is None or fitted == num_new or start >= seq.num_prompt_tokens:
            return fitted
        return 0 if step_has_others or slicer is not None else num_new

    def add_to_step(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        request = seq.request
        self.step_builder.add(
            out, seq.seq_id, seq.all_token_ids, seq.num_prompt_tokens, seq.num_computed_tokens,
            num_new, seq.wants_prompt_logprobs and seq.index == 0, request.params, seq.index,
            request.max_tokens, seq.mm_features, request.lora_request,
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
        if self.waiting or (self.encoder_slicer is not None and self.encoder_slicer.busy):
            return None  # encoder slices run in steps scheduled with the host's view
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
        out = SchedulerOutput(finished_seq_ids=self.step_builder.take_dropped(), block_copies=copies,
                              inputs_in_flight=True)
        for seq in seqs:
            self.add_to_step(out, seq, 1)
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """The step is running: its scheduled tokens count as computed. Drafts' KV is
        written but counts only once they are accepted (update_from_output)."""
        for seq_id, num in out.num_scheduled_tokens.items():
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.num_computed_tokens += num - len(out.spec_token_ids.get(seq_id, ()))

    # -- after the step --------------------------------------------------------------------

    def update_from_output(self, out: ModelRunnerOutput, inputs_were_in_flight: bool = False) -> list[SequenceUpdate]:
        """Append what the step sampled (the accepted part of verified runs), end the
        sequences whose tokens end them, give back the blocks of rejected drafts, and take
        the drafts of the next step. `inputs_were_in_flight`: an overlapped step, whose
        tokens were unknown when it was scheduled (its full blocks are registered now)."""
        if self.encoder_slicer is not None and out.encoder_evicted:
            self.encoder_slicer.forget(out.encoder_evicted)
        updates = []
        for sampled in out.sampled:
            seq = self.seqs.get(sampled.seq_id)
            if seq is None:
                continue  # ended by the step before (an overlapped step's extra token) or aborted
            updates.append(self._append(seq, sampled))
            if seq.status.is_finished:
                continue
            if sampled.num_drafts:
                self.kv_cache.trim(seq.seq_id, seq.num_computed_tokens)
            if inputs_were_in_flight and self.canonical is None:  # decoded K/V: never canonical
                self.kv_cache.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens,
                                                seq.mm_features, seq.lora_int_id)
        for seq_id, drafts in out.draft_token_ids.items():
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.spec_token_ids = drafts
                seq.spec_tree_parents = out.draft_tree_parents.get(seq_id)
        return updates

    def _append(self, seq: Sequence, sampled: SampledSequence) -> SequenceUpdate:
        if sampled.num_drafts:  # the accepted drafts' KV is valid where it was written in place
            seq.num_computed_tokens += (sampled.num_accepted if sampled.num_accepted_in_place is None
                                        else sampled.num_accepted_in_place)
            seq.clear_drafts()
        request = seq.request
        for i, token_id in enumerate(sampled.token_ids):
            seq.append_token(token_id)
            status, seq.stop_reason = check_stop(
                token_id, len(seq.output_token_ids), seq.num_tokens, request.params,
                request.max_tokens, self.eos_token_ids, self.max_model_len,
            )
            if status is not None:
                self.finish(seq, status)
                num = i + 1
                break
        else:
            num = len(sampled.token_ids)
        logprobs = None if sampled.logprobs is None else sampled.logprobs[:num]
        return SequenceUpdate(seq, sampled.token_ids[:num], logprobs, sampled.num_drafts, sampled.num_accepted)
