"""The scheduler under pipeline parallelism: several steps in flight at once, each scheduled
before the earlier ones' outputs are back. A fake pipeline keeps up to `depth` steps, writes
each step's KV when it is scheduled (every stage runs the steps in that order) and samples a
deterministic token when a step's output is read. No sequence may be in two steps in
flight, none in flight may be preempted, every sequence reads only its own KV, and every
output equals the one computed from its prompt alone."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched.output import SchedulerOutput
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from tests.core.test_scheduler import expected_output, greedy_token, make_seq, workloads


class FakePipeline:
    def __init__(self, depth: int, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                 chunked: bool, prefix_caching: bool, policy: str = "fcfs") -> None:
        self.depth = depth
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                               enable_chunked_prefill=chunked, policy=policy), self.kv)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.queue: deque[SchedulerOutput] = deque()
        self.target: dict[str, int] = {}
        self.pending: list[tuple[int, Sequence]] = []
        self.content: dict[int, list] = {}
        self.most_in_flight = 0
        self.step_no = 0

    def submit(self, seq: Sequence, max_tokens: int, at_step: int) -> None:
        self.target[seq.seq_id] = max_tokens
        self.pending.append((at_step, seq))

    def in_flight(self) -> set[str]:
        return {seq_id for out in self.queue for seq_id in out.num_scheduled_tokens}

    def step(self) -> None:
        for at, seq in list(self.pending):
            if at <= self.step_no:
                self.pending.remove((at, seq))
                self.sched.add(seq)
        self.step_no += 1
        if len(self.queue) < self.depth:
            in_flight = self.in_flight()
            out = self.sched.schedule(in_flight)
            assert not set(out.num_scheduled_tokens) & in_flight, "a sequence scheduled twice in flight"
            assert not set(out.preempted_seq_ids) & in_flight, "a sequence in flight was preempted"
            if not out.is_empty:
                self._write_kv(out)
                self.sched.advance(out)
                self.queue.append(out)
                self.most_in_flight = max(self.most_in_flight, len(self.queue))
                if len(self.queue) < self.depth:
                    return
        if self.queue:
            self._collect(self.queue.popleft())

    def _write_kv(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        for seq in self.sched.scheduled(out):
            table = self.kv.block_ids(seq.seq_id)
            end = seq.num_computed_tokens + out.num_scheduled_tokens[seq.seq_id]
            for pos in range(seq.num_computed_tokens, end):
                self.content.setdefault(table[pos // bs], [None] * bs)[pos % bs] = seq.all_token_ids[pos]
        for seq in self.sched.scheduled(out):
            table = self.kv.block_ids(seq.seq_id)
            end = seq.num_computed_tokens + out.num_scheduled_tokens[seq.seq_id]
            for pos in range(end):
                assert self.content[table[pos // bs]][pos % bs] == seq.all_token_ids[pos], (
                    f"{seq.seq_id} would attend to stale KV at position {pos}")

    def _collect(self, out: SchedulerOutput) -> None:
        for seq_id in out.num_scheduled_tokens:
            seq = self.sched.seqs[seq_id]  # nothing ends a sequence while its step is in flight
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(greedy_token(seq.all_token_ids))
                if len(seq.output_token_ids) >= self.target[seq_id]:
                    self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def run(self) -> None:
        while self.pending or self.sched.has_unfinished() or self.queue:
            assert self.step_no < 5000, "no progress: a request starves"
            self.step()
        assert self.kv.num_free_blocks == self.num_blocks


def test_two_stages_keep_two_steps_in_flight():
    pipeline = FakePipeline(2, num_blocks=64, block_size=2, max_num_seqs=8, budget=6, chunked=True,
                            prefix_caching=True)
    seqs = [make_seq(i, [i + 1] * (3 + 2 * i)) for i in range(4)]
    for seq in seqs:
        pipeline.submit(seq, max_tokens=5, at_step=0)
    pipeline.run()
    assert pipeline.most_in_flight == 2
    for seq in seqs:
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 5)


def test_two_prompts_short_of_blocks_do_not_take_turns_preempting_themselves():
    """Two 9-token prompts (arriving while a 6-token one runs) with 6 blocks of 2 cannot
    both hold their KV, and each step leaves the other in flight, where it cannot be
    preempted. The one admitted first waits for the other's step to come back and preempts
    it; preempting itself instead hands the blocks over each time it runs short, and
    neither ever finishes."""
    pipeline = FakePipeline(2, num_blocks=6, block_size=2, max_num_seqs=2, budget=1, chunked=True,
                            prefix_caching=False)
    seqs = [make_seq(i, [i + 1] * length) for i, length in enumerate([6, 9, 9])]
    for seq, arrival_step in zip(seqs, [0, 2, 2]):
        pipeline.submit(seq, max_tokens=1, at_step=arrival_step)
    pipeline.run()
    for seq in seqs:
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 1)


@settings(max_examples=80, deadline=None)
@given(w=workloads(), depth=st.integers(2, 4), policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workloads_through_a_pipeline(w, depth, policy):
    pipeline = FakePipeline(depth, w["num_blocks"], w["bs"], w["max_num_seqs"], w["budget"], w["chunked"],
                            w["prefix_caching"], policy)
    order = sorted(range(len(w["reqs"])), key=lambda i: (w["reqs"][i]["arrival_step"], i))
    seqs = {}
    for arrival, i in enumerate(order):
        request = w["reqs"][i]
        seqs[i] = make_seq(i, request["prompt"], priority=request["priority"], arrival=float(arrival))
        pipeline.submit(seqs[i], request["max_tokens"], request["arrival_step"])
    pipeline.run()
    for i, request in enumerate(w["reqs"]):
        assert seqs[i].output_token_ids == expected_output(request["prompt"], request["max_tokens"])


def test_sequences_dropped_while_nothing_runs_go_with_the_next_step():
    """A step that schedules nothing is never sent: the sequences the runner must forget
    go with the next step that runs (the engine puts them back)."""
    kv = KVCacheManager(16, 2, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    first, second = make_seq(0, [1, 2, 3]), make_seq(1, [4, 5])
    sched.add(first)
    assert sched.schedule().scheduled_seq_ids == ["s0"]
    sched.finish(first, SequenceStatus.FINISHED_ABORTED)
    empty = sched.schedule()
    assert empty.is_empty and empty.finished_seq_ids == ["s0"]
    sched.step_builder.put_back_dropped(empty.finished_seq_ids)
    sched.add(second)
    out = sched.schedule()
    assert out.scheduled_seq_ids == ["s1"] and out.finished_seq_ids == ["s0"]
