"""How much vision encoder work a step may start when images are encoded whole (no
--encoder-budget-per-step; encoder_slicer.py spreads them over steps instead): an image is
encoded whole in the step that computes its first placeholder token, so a prefill chunk that reaches several images
could make one step encode far more than its token budget and stall every running stream
for it. A step starts images only while their placeholder tokens fit the step's token
budget (the first image always starts, so a larger one still progresses); a chunk that
would start another ends before that image's first token."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.multimodal.inputs import ImageFeature


class EncoderBudget:
    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.num_left = budget_tokens

    def fit(self, images: Sequence[ImageFeature], start: int, num_new: int) -> int:
        """The tokens of [start, start + num_new) this step may compute, taking the budget
        of the images whose encoding they start."""
        for image in sorted(images, key=lambda f: f.offset):
            if not start <= image.offset < start + num_new:
                continue
            if image.length > self.num_left and self.num_left < self.budget_tokens:
                return image.offset - start
            self.num_left -= image.length
        return num_new
