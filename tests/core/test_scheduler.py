"""Scheduler tests: drive Scheduler.schedule() in a loop with a fake engine.

The fake engine, after every step, advances each scheduled sequence's num_computed_tokens,
writes the computed tokens into a simulated KV store (block id -> slot -> token), and when
a sequence has computed all its tokens appends a deterministic "greedy" token (a function
of the tokens so far, so equal prompts produce equal outputs and share prefix-cache
blocks), finishing it once it has its target output length.

All expectations (admission order, victims, budgets, the KV a sequence reads) are
computed by the test from its own records, not read back from the scheduler.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched.output import ModelRunnerOutput, SampledSequence
from kvserve.core.sched.scheduler import Scheduler
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.model_executor.input_batch import SequenceStates
from kvserve.sampling_params import SamplingParams

VOCAB = 7


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_seq(i: int, prompt: list[int], *, priority: int = 0, arrival: float | None = None):
    request = types.SimpleNamespace(
        request_id=f"r{i}",
        prompt_token_ids=list(prompt),
        params=types.SimpleNamespace(n=1, prompt_logprobs=None),
        priority=priority,
        arrival_time=float(i) if arrival is None else arrival,
        max_tokens=1 << 30,
        sequences=[],
        mm_features=[],
        lora_request=None,
        lora_int_id=0,
    )
    seq = Sequence(f"s{i}", request, 0)
    request.sequences.append(seq)
    return seq


def greedy_token(tokens: list[int]) -> int:
    return (sum((k + 1) * t for k, t in enumerate(tokens)) + 3 * len(tokens)) % VOCAB


class FakeEngine:
    def __init__(self, *, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                 policy="fcfs", chunked=True, prefix_caching=True, canonical_chunk=None):
        """`canonical_chunk`: batch-invariant scheduling, with the chunk size the test
        expects it to cut prompts at (ignored without chunking: prompts run whole)."""
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked,
            policy=policy,
            batch_invariant=canonical_chunk is not None,
        )
        self.batch_invariant = canonical_chunk is not None
        self.chunk = canonical_chunk if chunked else None
        # (block, slot)s last written by a full canonical chunk of prompt rows: the only
        # K/V a batch-invariant prefix hit may read.
        self.canonical_slots: set[tuple[int, int]] = set()
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(self.config, self.kv)
        self.bs = block_size
        self.num_blocks = num_blocks
        self.target: dict[str, int] = {}
        self.pending: list[tuple[int, Sequence]] = []  # (arrival step, seq)
        self.finished: list[Sequence] = []
        self.admissions: list[str] = []  # every WAITING -> RUNNING transition, in order
        self.first_admissions: list[str] = []
        self.victims: list[str] = []
        self.outputs = []  # SchedulerOutputs, one per step
        self.content: dict[int, list] = {}
        self.runner_view = SequenceStates()  # what a model runner rebuilds from the outputs
        self.step_no = 0
        self.key = (lambda s: (s.priority, s.arrival_time)) if policy == "priority" else (
            lambda s: (s.arrival_time,))

    def submit(self, seq: Sequence, max_tokens: int, at_step: int = 0) -> None:
        self.target[seq.seq_id] = max_tokens
        self.pending.append((at_step, seq))

    # -- one engine step -------------------------------------------------------------------

    def step(self):
        for at, seq in list(self.pending):
            if at <= self.step_no:
                self.pending.remove((at, seq))
                self.sched.add(seq)
        sched, cfg = self.sched, self.config
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        remaining_before = {s.seq_id: s.num_tokens - s.num_computed_tokens for s in running_before}
        computed_before = {s.seq_id: s.num_computed_tokens for s in running_before}

        out = sched.schedule()
        self.outputs.append(out)
        self.step_no += 1
        scheduled = sched.scheduled(out)
        ids = out.scheduled_seq_ids

        # A runner that knows only the outputs holds exactly each scheduled sequence's
        # tokens, progress and block table (the deltas add up), and nothing finished.
        self.runner_view.apply(out)
        for s in scheduled:
            held = self.runner_view[s.seq_id]
            assert held.token_ids == s.all_token_ids
            assert held.num_computed_tokens == s.num_computed_tokens
            assert held.block_ids.tolist() == self.kv.block_ids(s.seq_id)
        assert not {f.seq_id for f in self.finished} & set(self.runner_view)
        sizes = out.num_scheduled_tokens

        # Budgets and limits.
        assert sorted(ids) == sorted(sizes)
        assert len(set(ids)) == len(ids)
        # Without chunking, a prompt longer than the whole budget runs in a step of its own.
        assert sum(sizes.values()) <= cfg.max_num_batched_tokens or (
            not cfg.enable_chunked_prefill and len(sizes) == 1)
        assert len(sched.running) <= cfg.max_num_seqs
        assert all(n >= 1 for n in sizes.values())
        assert out.block_copies == []  # no forks here

        # Preemption victims: successive "worst" running sequences, by policy.
        by_id = {s.seq_id: s for s in running_before}
        preempted = [by_id[seq_id] for seq_id in out.preempted_seq_ids]
        if self.config.policy == "priority":
            expect = sorted(running_before, key=self.key, reverse=True)[: len(preempted)]
            assert [self.key(s) for s in preempted] == [self.key(s) for s in expect]
        else:
            assert preempted == list(reversed(running_before))[: len(preempted)]
        for victim in preempted:
            self.victims.append(victim.seq_id)
            assert victim.status is SequenceStatus.WAITING
            assert victim.num_computed_tokens == 0
            assert victim.seq_id not in self.kv.block_tables  # its blocks were freed
            assert victim.seq_id not in sizes
            assert victim in sched.waiting
        # Requeued ahead of every later arrival; the queue stays in policy order.
        keys = [self.key(s) for s in sched.waiting]
        assert keys == sorted(keys)

        # Running sequences are served before new prefills; new ones come in queue order.
        admitted = [s for s in scheduled if s not in running_before]
        kept = [s for s in running_before if s not in preempted]
        asked = {s.seq_id: self.asked(s, computed_before[s.seq_id], remaining_before[s.seq_id])
                 for s in running_before}
        assert ids[: len(ids) - len(admitted)] == [s.seq_id for s in kept if s.seq_id in sizes]
        assert scheduled[len(ids) - len(admitted):] == admitted
        if admitted:
            assert not preempted
            for s in kept:  # every running sequence got all it asked for first
                assert sizes[s.seq_id] == asked[s.seq_id]
            assert admitted == sorted(waiting_before, key=self.key)[: len(admitted)]
        for s in kept:
            if s.seq_id in sizes:
                assert sizes[s.seq_id] <= asked[s.seq_id]
                assert s.num_computed_tokens == computed_before[s.seq_id]
        for s in admitted:
            self.admissions.append(s.seq_id)
            if s.seq_id not in self.first_admissions:
                self.first_admissions.append(s.seq_id)
            assert s.num_computed_tokens % self.bs == 0
            assert s.num_computed_tokens + sizes[s.seq_id] <= s.num_tokens
            assert s.num_computed_tokens < s.num_tokens  # at least one token to compute
            if not self.config.enable_chunked_prefill:
                assert s.num_computed_tokens + sizes[s.seq_id] == s.num_tokens
        if self.batch_invariant:
            for s in scheduled:  # a prompt's pieces are exactly its canonical chunks
                start = s.num_computed_tokens
                if start < s.num_prompt_tokens:
                    chunk = self.chunk or s.num_tokens  # without chunking: whole
                    assert start % chunk == 0, (s.seq_id, start)
                    assert sizes[s.seq_id] == min(chunk, s.num_tokens - start), (s.seq_id, start)
            for s in admitted:  # a hit skips only K/V computed as this prompt's cold run would
                table = self.kv.block_ids(s.seq_id)
                assert all((table[pos // self.bs], pos % self.bs) in self.canonical_slots
                           for pos in range(s.num_computed_tokens))

        # Every scheduled sequence has room for its tokens.
        for s in scheduled:
            end = s.num_computed_tokens + sizes[s.seq_id]
            assert len(self.kv.block_ids(s.seq_id)) == cdiv(end, self.bs)

        # "Run the model": write the step's KV, then check every sequence reads its own.
        for s in scheduled:
            table = self.kv.block_ids(s.seq_id)
            start, num = s.num_computed_tokens, sizes[s.seq_id]
            full_chunk = (self.chunk is not None and start % self.chunk == 0 and num == self.chunk
                          and start + num <= s.num_prompt_tokens)
            for pos in range(start, start + num):
                slot = (table[pos // self.bs], pos % self.bs)
                (self.canonical_slots.add if full_chunk else self.canonical_slots.discard)(slot)
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + sizes[s.seq_id]):
                self.content.setdefault(table[pos // self.bs], [None] * self.bs)[
                    pos % self.bs
                ] = s.all_token_ids[pos]
        for s in scheduled:
            table = self.kv.block_ids(s.seq_id)
            end = s.num_computed_tokens + sizes[s.seq_id]
            for pos in range(end):
                assert self.content[table[pos // self.bs]][pos % self.bs] == s.all_token_ids[pos], (
                    f"{s.seq_id} would attend to stale KV at position {pos}"
                )

        # Advance; sample and finish.
        for s in scheduled:
            s.num_computed_tokens += sizes[s.seq_id]
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(greedy_token(s.all_token_ids))
                if len(s.output_token_ids) >= self.target[s.seq_id]:
                    sched.finish(s, SequenceStatus.FINISHED_LENGTH)
                    self.finished.append(s)
        self.check_pool()
        return out

    def asked(self, seq: Sequence, start: int, remaining: int) -> int:
        """Tokens a running sequence asks for: all it has left, or, batch-invariant, its
        prompt's next canonical piece."""
        if self.chunk is None or start >= seq.num_prompt_tokens:
            return remaining
        return min(remaining, self.chunk - start % self.chunk)

    def check_pool(self):
        pool = self.kv.pool
        held = {}
        for table in self.kv.block_tables.values():
            for b in table:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_count == held.get(b.block_id, 0)
        assert pool.num_free_blocks + len(held) == self.num_blocks
        live = {s.seq_id for s in self.sched.running}
        assert set(self.kv.block_tables) == live
        assert all(s.status is SequenceStatus.WAITING for s in self.sched.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in self.sched.running)

    def run(self, max_steps=5000):
        while self.pending or self.sched.has_unfinished():
            assert self.step_no < max_steps, "no progress: a request starves"
            self.step()
        # Everything finished, with exactly its target number of tokens; nothing held.
        for seq in self.finished:
            assert seq.status is SequenceStatus.FINISHED_LENGTH
            assert len(seq.output_token_ids) == self.target[seq.seq_id]
        assert len(self.finished) == len(self.target)
        assert self.kv.block_tables == {}
        assert self.kv.num_free_blocks == self.num_blocks
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(greedy_token(tokens))
    return tokens[len(prompt):]


# -- deterministic scenarios -------------------------------------------------------------


def test_chunked_prefill_splits_long_prompt():
    eng = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    seq = make_seq(0, list(range(10)))
    eng.submit(seq, max_tokens=3)
    eng.run()
    sizes = [o.num_scheduled_tokens.get("s0") for o in eng.outputs]
    assert sizes == [4, 4, 2, 1, 1]
    assert seq.output_token_ids == expected_output(list(range(10)), 3)


def test_no_chunking_waits_for_full_prompt_budget():
    eng = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=6,
                     chunked=False)
    a, b = make_seq(0, [1] * 3), make_seq(1, [2] * 5)
    eng.submit(a, max_tokens=3)
    eng.submit(b, max_tokens=1)
    eng.run()
    # Step 0: a's 3-token prompt fits, b's 5 do not (3 left). Step 1: decode a (1) + b (5).
    assert eng.outputs[0].num_scheduled_tokens == {"s0": 3}
    assert eng.outputs[1].num_scheduled_tokens == {"s0": 1, "s1": 5}


def test_no_chunking_runs_a_prompt_over_the_whole_budget_alone():
    """It used to wait forever (the budget never grows), holding up every request behind it."""
    eng = FakeEngine(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=6,
                     chunked=False)
    a, b, c = make_seq(0, [1] * 3), make_seq(1, list(range(9))), make_seq(2, [2] * 2)
    eng.submit(a, max_tokens=2)
    eng.submit(b, max_tokens=2)
    eng.submit(c, max_tokens=1)
    eng.run()
    # a's prompt, a's decode; then b alone (9 > 6), then b's decode beside c's prompt.
    assert [o.num_scheduled_tokens for o in eng.outputs[:4]] == [
        {"s0": 3}, {"s0": 1}, {"s1": 9}, {"s1": 1, "s2": 2}]
    assert b.output_token_ids == expected_output(list(range(9)), 2)
    assert c.output_token_ids == expected_output([2] * 2, 1)


def test_decodes_scheduled_before_new_prefill():
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    eng.submit(make_seq(0, [1, 2, 3]), max_tokens=6)
    eng.submit(make_seq(1, [4, 5]), max_tokens=6)
    eng.submit(make_seq(2, list(range(20))), max_tokens=2, at_step=2)
    eng.run()
    out2 = eng.outputs[2]
    assert out2.scheduled_seq_ids == ["s0", "s1", "s2"]
    assert out2.num_scheduled_tokens == {"s0": 1, "s1": 1, "s2": 6}
    # While s2's prefill is chunked, the decodes of s0 and s1 keep flowing.
    out3 = eng.outputs[3]
    assert out3.num_scheduled_tokens == {"s0": 1, "s1": 1, "s2": 6}


def test_max_num_seqs_limits_admission():
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        eng.submit(make_seq(i, [i] * 3), max_tokens=2)
    eng.run()
    assert eng.first_admissions == [f"s{i}" for i in range(5)]
    assert eng.outputs[0].num_scheduled_tokens == {"s0": 3, "s1": 3}
    assert max(len(o.num_scheduled_tokens) for o in eng.outputs) == 2


def test_fcfs_admits_in_arrival_order_not_submission_order():
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    for i, arrival in enumerate([3.0, 1.0, 2.0, 0.5]):
        eng.submit(make_seq(i, [i + 1] * 2, arrival=arrival), max_tokens=1)
    eng.run()
    assert eng.first_admissions == ["s3", "s1", "s2", "s0"]


def test_priority_admits_lower_value_first():
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                     policy="priority")
    prios = [5, 1, 3, 1, 0]
    for i, p in enumerate(prios):
        eng.submit(make_seq(i, [i + 1] * 2, priority=p), max_tokens=1)
    eng.run()
    # Ties broken by arrival.
    assert eng.first_admissions == ["s4", "s1", "s3", "s2", "s0"]


def test_fcfs_preempts_latest_admitted_and_requeues_at_front():
    bs = 2
    eng = FakeEngine(num_blocks=6, block_size=bs, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = make_seq(0, [1, 1]), make_seq(1, [2, 2]), make_seq(2, [3, 3])
    for s in (a, b, c):
        eng.submit(s, max_tokens=6)  # each needs up to 4 blocks; 3 * 4 > 6
    eng.submit(make_seq(3, [4, 4]), max_tokens=1, at_step=1)
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert eng.victims[0] == "s2"  # the latest admitted goes first
    # s2 was requeued ahead of the later arrival s3 and readmitted before it.
    assert eng.admissions.index("s3") > eng.admissions.index("s2", 3)
    for s in (a, b, c):
        assert s.output_token_ids == expected_output(s.prompt_token_ids, 6)


def test_priority_preempts_lowest_priority_running():
    bs = 2
    eng = FakeEngine(num_blocks=5, block_size=bs, max_num_seqs=8, max_num_batched_tokens=64,
                     policy="priority")
    low = make_seq(0, [1, 1], priority=9)
    mid = make_seq(1, [2, 2], priority=5)
    eng.submit(low, max_tokens=6)
    eng.submit(mid, max_tokens=6)
    hi = make_seq(2, [3, 3], priority=0)
    eng.submit(hi, max_tokens=6, at_step=1)
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert eng.victims[0] == "s0"
    for s in (low, mid, hi):
        assert s.output_token_ids == expected_output(s.prompt_token_ids, 6)


def test_priority_preempting_an_already_scheduled_sequence():
    """The lowest-priority sequence is first in the running list and already scheduled
    when a later, higher-priority one runs out of blocks. Its blocks filled "this step"
    must not stay in the prefix cache: the step will not run for it."""
    bs = 2
    eng = FakeEngine(num_blocks=4, block_size=bs, max_num_seqs=8, max_num_batched_tokens=3,
                     policy="priority")
    low = make_seq(0, [1, 2, 3, 4, 5], priority=9)
    eng.submit(low, max_tokens=2)
    eng.step()  # low: tokens 0..2 computed (2 blocks)
    hi = make_seq(1, [6, 6, 6], priority=0, arrival=0.5)
    eng.submit(hi, max_tokens=3, at_step=1)
    eng.run()
    assert eng.sched.num_preemptions > 0
    # The step where s0 ran ahead of s1 in the running list, was scheduled, and then
    # became the victim of s1's allocation: it must be dropped from that step's batch.
    out = next(o for o in eng.outputs if low.seq_id in o.preempted_seq_ids)
    assert out.scheduled_seq_ids == ["s1"]
    assert list(out.num_scheduled_tokens) == ["s1"]
    assert low.output_token_ids == expected_output(low.prompt_token_ids, 2)
    assert hi.output_token_ids == expected_output(hi.prompt_token_ids, 3)


def test_identical_prompts_share_prefix_and_give_same_output():
    eng = FakeEngine(num_blocks=30, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, 14))
    first = make_seq(0, prompt)
    eng.submit(first, max_tokens=4)
    second = make_seq(1, prompt)
    eng.submit(second, max_tokens=4, at_step=10)
    eng.run()
    assert eng.sched.prefix_cache_stats.hit_tokens == 12
    assert eng.outputs[10].num_scheduled_tokens == {"s1": 1}
    assert first.output_token_ids == second.output_token_ids == expected_output(prompt, 4)


# -- randomized workloads ----------------------------------------------------------------


@st.composite
def workloads(draw):
    bs = draw(st.integers(1, 4))
    n = draw(st.integers(1, 7))
    shared_prefix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
    reqs = []
    for i in range(n):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
        prompt = (shared_prefix if draw(st.booleans()) else []) + own
        reqs.append(dict(
            prompt=prompt,
            max_tokens=draw(st.integers(1, 8)),
            priority=draw(st.integers(0, 3)),
            arrival_step=draw(st.integers(0, 6)),
        ))
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
    min_blocks = cdiv(longest, bs)
    chunked = draw(st.booleans())
    min_budget = 1 if chunked else max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
    return dict(
        bs=bs,
        reqs=reqs,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 12)),
        max_num_seqs=draw(st.integers(1, 6)),
        budget=draw(st.integers(min_budget, min_budget + 24)),
        chunked=chunked,
        prefix_caching=draw(st.booleans()),
    )


def run_workload(w, policy, canonical_chunk=None):
    """Every request of workload `w` run to the end (FakeEngine.run fails if one starves),
    each output checked; `canonical_chunk`: batch-invariant scheduling with that chunk."""
    eng = FakeEngine(num_blocks=w["num_blocks"], block_size=w["bs"],
                     max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                     policy=policy, chunked=w["chunked"], prefix_caching=w["prefix_caching"],
                     canonical_chunk=canonical_chunk)
    # Requests arrive over time; arrival_time follows the arrival step.
    order = sorted(range(len(w["reqs"])), key=lambda i: (w["reqs"][i]["arrival_step"], i))
    seqs = {}
    for rank, i in enumerate(order):
        r = w["reqs"][i]
        seqs[i] = make_seq(i, r["prompt"], priority=r["priority"], arrival=float(rank))
        eng.submit(seqs[i], r["max_tokens"], at_step=r["arrival_step"])
    eng.run()
    for i, r in enumerate(w["reqs"]):
        assert seqs[i].output_token_ids == expected_output(r["prompt"], r["max_tokens"])
    return eng, seqs


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(w=workloads())
def test_random_workload_fcfs(w):
    eng, seqs = run_workload(w, "fcfs")
    # First admissions follow arrival order.
    arrivals = [seqs[int(sid[1:])].arrival_time for sid in eng.first_admissions]
    assert arrivals == sorted(arrivals)


@SETTINGS
@given(w=workloads())
def test_random_workload_priority(w):
    run_workload(w, "priority")


@settings(max_examples=40, deadline=None)
@given(bs=st.integers(1, 3), n=st.integers(3, 6), data=st.data())
def test_tight_pool_forces_preemption_and_all_finish(bs, n, data):
    prompts = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=6))
               for _ in range(n)]
    max_tokens = 6
    longest = max(len(p) for p in prompts) + max_tokens
    # Room for the longest request alone, but not for all of them at once.
    num_blocks = cdiv(longest, bs)
    assert sum(cdiv(len(p) + max_tokens - 1, bs) for p in prompts) > num_blocks
    for policy in ("fcfs", "priority"):
        eng = FakeEngine(num_blocks=num_blocks, block_size=bs, max_num_seqs=n,
                         max_num_batched_tokens=64, policy=policy)
        seqs = [make_seq(i, p, priority=i % 3) for i, p in enumerate(prompts)]
        for s in seqs:
            eng.submit(s, max_tokens)
        eng.run()
        assert eng.sched.num_preemptions > 0
        assert sum(s.num_preemptions for s in seqs) == eng.sched.num_preemptions
        for s, p in zip(seqs, prompts):
            assert s.output_token_ids == expected_output(p, max_tokens)


# -- n > 1: a prompt forks into its samples ----------------------------------------------


def make_request(i: int, prompt: list[int], n: int, max_tokens: int) -> Sequence:
    request = types.SimpleNamespace(
        request_id=f"r{i}", prompt_token_ids=list(prompt),
        params=SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
        priority=0, arrival_time=float(i), max_tokens=max_tokens, sequences=[],
        mm_features=[],
        lora_request=None, lora_int_id=0,
    )
    seq = Sequence(f"r{i}#0", request, 0)
    request.sequences.append(seq)
    return seq


def expected_sample(prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """Sample `index` draws its first token from its parent's logits (here: the prompt plus
    its index), then goes on greedily from its own tokens."""
    tokens = list(prompt)
    tokens.append(greedy_token(tokens + [index] if index else tokens))
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(greedy_token(tokens))
    return tokens[len(prompt):]


def run_forking(sched: Scheduler, arrivals: list[tuple[int, Sequence]], max_num_seqs: int,
                observe: Callable[[Scheduler], None] = lambda sched: None) -> list[dict]:
    """schedule -> advance -> update_from_output with a fake runner, asserting after every
    schedule() that no more than max_num_seqs sequences run (and handing the scheduler to
    `observe`); returns each step's record."""
    pending, steps = list(arrivals), []
    while pending or sched.has_unfinished():
        assert len(steps) < 3000, "no progress"
        for at, seq in list(pending):
            if at <= len(steps):
                pending.remove((at, seq))
                sched.add(seq)
        out = sched.schedule()
        assert len(sched.running) <= max_num_seqs, out
        observe(sched)
        steps.append({"running": len(sched.running), "scheduled": out.scheduled_seq_ids,
                      "forks": dict(out.forks)})
        sched.advance(out)
        sampled = []
        for seq in sched.scheduled(out):
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(SampledSequence(seq.seq_id, [greedy_token(seq.all_token_ids)]))
                for child_id, index in out.forks.get(seq.seq_id, ()):
                    prompt = sched.seqs[child_id].all_token_ids
                    sampled.append(SampledSequence(child_id, [greedy_token(prompt + [index])]))
        sched.update_from_output(ModelRunnerOutput(sampled))
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.pool.num_blocks
    return steps


def test_a_prompt_is_admitted_only_when_all_its_samples_fit_max_num_seqs():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(config, KVCacheManager(64, 4))
    first, second, third = (make_request(0, [1, 2, 3], 3, 3), make_request(1, [4, 5], 3, 2),
                            make_request(2, [6], 1, 2))
    steps = run_forking(sched, [(0, first), (0, second), (0, third)], 4)
    # Admitting all three at once (3 < 4 running before the forks) would run 3 + 3 + 1.
    assert steps[0] == {"running": 3, "scheduled": ["r0#0"], "forks": {"r0#0": [("r0#1", 1), ("r0#2", 2)]}}
    # r1 waits until r0's samples end (3 + 3 > 4); r2 keeps its place behind it (FCFS).
    second_admitted = next(i for i, step in enumerate(steps) if "r1#0" in step["scheduled"])
    assert all(s not in step["scheduled"] for step in steps[:second_admitted] for s in ("r1#0", "r2#0"))
    assert steps[second_admitted - 1]["scheduled"] == ["r0#0", "r0#1", "r0#2"]  # r0's last step
    assert steps[second_admitted]["scheduled"] == ["r1#0", "r2#0"]
    assert steps[second_admitted]["running"] == 4
    for seq in (first, second, third):
        request = seq.request
        assert [s.output_token_ids for s in request.sequences] == [
            expected_sample(request.prompt_token_ids, i, request.max_tokens) for i in range(request.params.n)]


def test_preempted_samples_wait_as_sequences_of_a_request_that_waits_only_with_none_running():
    """What the gauges report (kvserve:num_sequences_waiting, num_requests_waiting): each
    preempted sample is a waiting sequence; its request counts as running while any of its
    samples runs, and as one waiting request once none does."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(14, 2))
    first, second = make_request(0, [1, 2, 3], 3, 8), make_request(1, [4, 5, 6], 3, 8)
    seen = []

    def count(sched: Scheduler) -> None:
        by_request = [([s for s in sched.running if s.request is r], [s for s in sched.waiting if s.request is r])
                      for r in (first.request, second.request)]
        running_requests = sum(bool(running) for running, _ in by_request)
        waiting_requests = sum(bool(waiting) and not running for running, waiting in by_request)
        assert sched.num_requests() == (running_requests, waiting_requests)
        seen.append([(len(running), len(waiting)) for running, waiting in by_request])

    run_forking(sched, [(0, first), (0, second)], 8, observe=count)
    assert sched.num_preemptions > 0
    samples = [pair for step in seen for pair in step]
    assert (0, 3) in samples  # all three samples waiting: three sequences, one request
    assert any(running and waiting for running, waiting in samples)  # some running: a running request


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_forking_workload_never_runs_more_than_max_num_seqs(data):
    bs = data.draw(st.integers(1, 4))
    max_num_seqs = data.draw(st.integers(3, 6))
    requests = []
    for i in range(data.draw(st.integers(1, 6))):
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10))
        n = data.draw(st.integers(1, max_num_seqs))
        requests.append((data.draw(st.integers(0, 5)),
                         make_request(i, prompt, n, data.draw(st.integers(1, 6)))))
    longest = max(seq.num_tokens + seq.request.max_tokens for _, seq in requests)
    num_blocks = data.draw(st.integers(cdiv(longest, bs) + 1, cdiv(longest, bs) + 30))
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=data.draw(st.integers(1, 24)))
    sched = Scheduler(config, KVCacheManager(num_blocks, bs, enable_prefix_caching=data.draw(st.booleans())))
    run_forking(sched, requests, max_num_seqs)
    for _, seq in requests:
        request = seq.request
        assert [s.output_token_ids for s in request.sequences] == [
            expected_sample(request.prompt_token_ids, i, request.max_tokens) for i in range(request.params.n)]
