"""The runner's side of vision encoding spread over steps (core/sched/encoder_slicer.py):
each job's partial state between its slices, and its images' embeddings handed to the
encoder cache when its last slice has run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kvserve.core.sched.output import EncoderSlice
from kvserve.model_executor.encoder_cache import EncoderCache
from kvserve.multimodal.inputs import ImageFeature


class SlicedEncoder:
    def __init__(self, cache: EncoderCache) -> None:
        self.cache = cache
        self._jobs: dict[int, tuple[list[ImageFeature], Any]] = {}  # job id -> (images, tower state)
        self.num_units_run = 0  # row-passes run, all jobs together

    def __len__(self) -> int:
        """Jobs part way through the tower."""
        return len(self._jobs)

    def cancel(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            self._jobs.pop(job_id, None)

    def run(self, slices: Iterable[EncoderSlice], model, sync: Callable[[], None]) -> None:
        """Run this step's slices; `sync` waits for the device, so that the time is measured."""
        for piece in slices:
            start = time.perf_counter()
            if piece.images:
                self._jobs[piece.job_id] = (piece.images, model.begin_encoding(
                    [image.tensors for image in piece.images]))
            images, state = self._jobs[piece.job_id]
            self.num_units_run += model.advance_encoding(state, piece.num_units)
            embeddings = model.finish_encoding(state) if state.finished else None
            sync()
            self.cache.encoder_seconds += time.perf_counter() - start
            if embeddings is not None:
                del self._jobs[piece.job_id]
                self.cache.put(images, embeddings)
                self.cache.num_images_encoded += len(images)
