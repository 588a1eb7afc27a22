"""The scheduler's side of vision encoding spread over steps: which tokens a chunk may
compute, how images pack into jobs, exact row-passes per step, and cancellation."""

from __future__ import annotations

import torch

from kvserve.config import EncoderSlicing
from kvserve.core.sched.encoder_slicer import EncoderSlicer
from kvserve.multimodal.inputs import ImageFeature

PASSES, GROUP = 3, 4


def _image(name: str, offset: int, rows: int) -> ImageFeature:
    return ImageFeature(name, offset, rows // GROUP, {"pixel_values": torch.zeros(rows, 1)})


def _slicer(budget: int, max_job_tokens: int = 1000) -> EncoderSlicer:
    return EncoderSlicer(EncoderSlicing(budget, PASSES, GROUP), max_job_tokens)


def test_a_chunk_stops_before_an_unready_image_and_wants_every_one_it_reaches():
    slicer = _slicer(budget=24)
    a, b = _image("a", 5, 16), _image("b", 12, 8)  # 4 and 2 placeholder tokens
    assert slicer.fit("s", [b, a], 0, 20) == 5
    (piece,) = slicer.take_step()
    assert [image.image_hash for image in piece.images] == ["a", "b"]  # one job, batched
    assert piece.num_units == 24  # of (16 + 8) * 3 = 72
    assert slicer.fit("s", [a, b], 5, 15) == 0  # still encoding
    assert [p.num_units for p in slicer.take_step()] == [24]
    assert [p.num_units for p in slicer.take_step()] == [24]
    assert slicer.ready == {"a", "b"} and not slicer.busy
    assert slicer.fit("s", [a, b], 5, 15) == 15


def test_each_step_runs_exactly_its_budget_over_jobs_oldest_first():
    slicer = _slicer(budget=20)
    slicer.fit("s1", [_image("a", 0, 4)], 0, 10)  # 12 row-passes
    first = slicer.take_step()
    assert [(p.job_id, p.num_units) for p in first] == [(0, 12)]
    slicer.fit("s2", [_image("b", 0, 8)], 0, 10)  # 24
    assert [(p.job_id, p.num_units) for p in slicer.take_step()] == [(1, 20)]
    slicer.fit("s3", [_image("c", 0, 8)], 0, 10)  # a job of its own: 24
    assert [(p.job_id, p.num_units) for p in slicer.take_step()] == [(1, 4), (2, 16)]
    assert [(p.job_id, p.num_units) for p in slicer.take_step()] == [(2, 8)]
    assert slicer.ready == {"a", "b", "c"}


def test_budget_in_whole_groups_and_at_least_one_group_a_step():
    slicer = _slicer(budget=3)  # below a group: one group a step still
    slicer.fit("s", [_image("a", 0, 8)], 0, 10)
    grants = []
    while True:
        pieces = slicer.take_step()
        if not pieces:
            break
        grants.append(sum(p.num_units for p in pieces))
    assert grants == [GROUP] * (8 * PASSES // GROUP)
    slicer = _slicer(budget=10)  # rounded down to whole groups
    slicer.fit("s", [_image("a", 0, 8)], 0, 10)
    assert [p.num_units for p in slicer.take_step()] == [8]


def test_a_job_packs_images_within_the_token_budget():
    slicer = _slicer(budget=1000, max_job_tokens=5)
    images = [_image("a", 1, 16), _image("b", 10, 16), _image("c", 20, 4)]  # 4, 4, 1 tokens
    slicer.fit("s", images, 0, 30)
    (piece,) = slicer.take_step()
    assert [image.image_hash for image in piece.images] == ["a"]  # b would exceed 5 tokens
    slicer.fit("s", images, 1, 29)  # a is ready now: b and c wanted
    (piece,) = slicer.take_step()
    assert [image.image_hash for image in piece.images] == ["b", "c"]  # 5 tokens


def test_a_job_nobody_waits_for_is_cancelled_once_and_only_if_started():
    slicer = _slicer(budget=4)
    slicer.fit("s1", [_image("a", 0, 8)], 0, 10)
    slicer.fit("s2", [_image("a", 3, 8)], 3, 10)  # the same image in another request
    slicer.take_step()
    slicer.release("s1")
    assert slicer.busy and slicer.take_cancelled() == []  # s2 still waits
    slicer.release("s2")
    assert not slicer.busy and slicer.take_cancelled() == [0]
    assert slicer.take_cancelled() == []
    # Wanted and released within one step: never started, nothing to tell the runner.
    slicer.fit("s3", [_image("b", 0, 8)], 0, 10)
    slicer.release("s3")
    assert slicer.take_step() == [] and slicer.take_cancelled() == []


def test_an_evicted_image_is_encoded_again_when_next_wanted():
    slicer = _slicer(budget=1000)
    image = _image("a", 0, 8)
    slicer.fit("s", [image], 0, 10)
    slicer.take_step()
    assert slicer.fit("s2", [image], 0, 10) == 10
    slicer.forget(["a"])
    assert slicer.fit("s2", [image], 0, 10) == 0
    assert slicer.take_step()[0].images == [image]
