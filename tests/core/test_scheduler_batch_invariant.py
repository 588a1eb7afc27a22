"""Batch-invariant scheduling: a prompt is cut only at multiples of the canonical chunk size
(its pieces never depend on the budget other requests leave), a piece that does not fit
waits whole for a later step, nothing starves, and a prefix hit skips only whole canonical
chunks that were computed as such. FakeEngine (test_scheduler.py) checks every step: the
pieces, budgets, admission order, preemption victims and the K/V each hit reads."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.core.sched.canonical_chunks import canonical_chunk_size
from kvserve.multimodal.inputs import ImageFeature
from tests.core.test_scheduler import FakeEngine, expected_output, make_seq, run_workload, workloads


def test_the_chunk_size_leaves_room_for_a_full_batch_of_decodes_in_whole_blocks():
    assert canonical_chunk_size(512, 256, 16) == 256  # CPU defaults
    assert canonical_chunk_size(2048, 256, 16) == 1792
    assert canonical_chunk_size(512, 4, 16) == 496  # 508 in whole blocks
    assert canonical_chunk_size(16, 4, 4) == 12
    assert canonical_chunk_size(8, 256, 16) == 8  # under a block: the whole budget


def prompt_pieces(eng: FakeEngine, seq_id: str) -> list[int]:
    return [out.num_scheduled_tokens[seq_id] for out in eng.outputs if seq_id in out.num_scheduled_tokens]


def test_a_prompt_beside_decodes_is_cut_where_it_is_cut_alone():
    # Budget 16, 4 sequences: chunks of 12. Without batch invariance the two decodes would
    # leave the prompt pieces of 14, 14 and 2.
    prompt = list(range(30))
    alone = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, canonical_chunk=12)
    alone.submit(make_seq(2, prompt), max_tokens=3)
    alone.run()
    beside = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, canonical_chunk=12)
    beside.submit(make_seq(0, [1, 2, 3]), max_tokens=12)
    beside.submit(make_seq(1, [4, 5]), max_tokens=12)
    long = make_seq(2, prompt)
    beside.submit(long, max_tokens=3, at_step=2)
    beside.run()
    assert prompt_pieces(alone, "s2") == prompt_pieces(beside, "s2") == [12, 12, 6, 1, 1]
    assert [out.num_scheduled_tokens for out in beside.outputs[2:5]] == [
        {"s0": 1, "s1": 1, "s2": 12}, {"s0": 1, "s1": 1, "s2": 12}, {"s0": 1, "s1": 1, "s2": 6}]
    assert long.output_token_ids == expected_output(prompt, 3)


def test_a_piece_the_step_has_no_room_for_waits_whole_and_runs_later():
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, canonical_chunk=12)
    a, b = make_seq(0, list(range(30))), make_seq(1, list(range(1, 31)))
    eng.submit(a, max_tokens=4)
    eng.submit(b, max_tokens=2)
    eng.run()
    # b's first piece needs 12: it waits while a's pieces leave 4 and 10, never taking less.
    assert [out.num_scheduled_tokens for out in eng.outputs[:6]] == [
        {"s0": 12}, {"s0": 12}, {"s0": 6}, {"s0": 1, "s1": 12}, {"s0": 1, "s1": 12}, {"s0": 1, "s1": 6}]
    assert b.output_token_ids == expected_output(list(range(1, 31)), 2)


def test_a_prefix_hit_skips_only_whole_chunks_computed_as_prompt_chunks():
    eng = FakeEngine(num_blocks=60, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, canonical_chunk=12)
    prompt = list(range(40))
    first = make_seq(0, prompt)
    eng.submit(first, max_tokens=6)
    eng.run()
    # Cached and canonical: [0, 36), its three full chunks. Blocks 36-43 hold the last
    # chunk (4 prompt rows) and decoded tokens: a cold run of a longer prompt computes them
    # as prompt rows, so they are not found.
    follow_up = make_seq(1, prompt + first.output_token_ids + [1, 2, 3])
    shared_28 = make_seq(2, prompt[:30] + [6] * 20)  # 7 shared blocks, 2 whole chunks
    repeat = make_seq(3, prompt)
    for seq in (follow_up, shared_28, repeat):
        before = eng.sched.prefix_cache_stats.hit_tokens
        eng.submit(seq, max_tokens=2, at_step=eng.step_no)
        eng.run()
        hit = eng.sched.prefix_cache_stats.hit_tokens - before
        assert (seq.seq_id, hit) in {("s1", 36), ("s2", 24), ("s3", 36)}
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 2)
    assert prompt_pieces(eng, "s1") == [12, 1, 1] and prompt_pieces(eng, "s2") == [12, 12, 2, 1]
    assert prompt_pieces(eng, "s3") == [4, 1]


def test_a_piece_that_would_start_too_much_image_encoding_waits_then_runs_whole_alone():
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, canonical_chunk=12)
    eng.submit(make_seq(0, [1, 2, 3]), max_tokens=4)
    with_images = make_seq(1, list(range(30)))
    # Both start in the first chunk, 4 + 14 placeholder tokens: more than the step's 16
    # (which would end the piece before the second image, at 8).
    with_images.request.mm_features = [ImageFeature(f"h{offset}", offset, length, {"pixel_values": torch.zeros(1)})
                                       for offset, length in ((2, 4), (8, 14))]
    eng.submit(with_images, max_tokens=2, at_step=1)
    eng.run()
    assert [out.num_scheduled_tokens for out in eng.outputs[:6]] == [
        {"s0": 3}, {"s0": 1}, {"s0": 1}, {"s0": 1}, {"s1": 12}, {"s1": 12}]
    assert with_images.output_token_ids == expected_output(list(range(30)), 2)


def test_whole_prompts_batch_invariant_take_no_prefix_hits():
    # Without chunking a cold run computes a prompt in one piece: no hit reproduces it.
    eng = FakeEngine(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, chunked=False,
                     canonical_chunk=64)
    prompt = list(range(20))
    eng.submit(make_seq(0, prompt), max_tokens=2)
    eng.submit(make_seq(1, prompt), max_tokens=2, at_step=4)
    eng.run()
    assert eng.sched.prefix_cache_stats.hit_tokens == 0
    assert prompt_pieces(eng, "s1") == [20, 1]


# Found by the search: a running prompt's 2-token piece did not fit the 1 token a decode
# left, and a new 1-token prompt took that token (and a block) ahead of it.
PIECE_DEFERRED = {
    "bs": 2, "num_blocks": 10, "max_num_seqs": 3, "budget": 4, "chunked": True, "prefix_caching": False,
    "reqs": [{"prompt": [0] * n, "max_tokens": m, "priority": 0, "arrival_step": a}
             for n, m, a in ((1, 1, 1), (5, 8, 0), (1, 1, 0), (8, 4, 0), (1, 1, 0), (1, 1, 0), (6, 1, 0))],
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(), policy=st.sampled_from(["fcfs", "priority"]))
@example(w=PIECE_DEFERRED, policy="fcfs")
def test_random_workloads_cut_prompts_at_canonical_boundaries_and_all_finish(w, policy):
    chunk = canonical_chunk_size(w["budget"], w["max_num_seqs"], w["bs"]) if w["chunked"] else w["budget"]
    run_workload(w, policy, canonical_chunk=chunk)  # FakeEngine checks every step's pieces and hits
