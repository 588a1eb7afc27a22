"""A step starts vision encoder work only while the images' placeholder tokens fit its
token budget; the first image of a step always starts."""

from __future__ import annotations

import torch

from kvserve.core.sched.encoder_budget import EncoderBudget
from kvserve.multimodal.inputs import ImageFeature


def _image(offset: int, length: int) -> ImageFeature:
    return ImageFeature(f"h{offset}", offset, length, {"pixel_values": torch.zeros(1)})


def test_a_chunk_ends_before_an_image_the_budget_cannot_start():
    budget = EncoderBudget(16)
    images = [_image(2, 10), _image(14, 10)]
    assert budget.fit(images, 0, 16) == 14  # the second image waits for the next step
    assert budget.num_left == 6


def test_the_first_image_of_a_step_starts_however_large():
    budget = EncoderBudget(16)
    assert budget.fit([_image(0, 40)], 0, 16) == 16
    # Nothing more starts in this step, even in another sequence's chunk.
    assert budget.fit([_image(3, 1)], 0, 8) == 3


def test_images_already_started_or_outside_the_chunk_take_no_budget():
    budget = EncoderBudget(16)
    images = [_image(0, 12), _image(30, 12)]
    assert budget.fit(images, 5, 16) == 16  # resumes inside the first image, ends before the second
    assert budget.num_left == 16
