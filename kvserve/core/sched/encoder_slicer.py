"""Vision encoder work spread over steps. Encoding an image whole inside one step holds every
running stream for the whole tower; instead, the images a step's prefill chunks reach are
packed into a job, and each step runs at most `budget_per_step` row-passes of the jobs in
order (see config.EncoderSlicing), beside its decodes and prefill chunks. A chunk stops
before an image whose embeddings are not complete; once its job's last slice is scheduled
the image is ready, and the next step may compute its placeholder tokens.

The runner keeps each job's partial state until its last slice; a job no sequence waits
for any more (finished, aborted or preempted) is cancelled and its state dropped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvserve.config import EncoderSlicing
from kvserve.core.sched.output import EncoderSlice
from kvserve.multimodal.inputs import ImageFeature


@dataclass
class _Job:
    job_id: int
    images: list[ImageFeature]
    total_units: int
    owners: set[str]  # sequences waiting for its images
    done_units: int = 0  # scheduled so far
    started: bool = False  # the runner has its images

    @property
    def hashes(self) -> list[str]:
        return [image.image_hash for image in self.images]


@dataclass
class EncoderSlicer:
    slicing: EncoderSlicing
    max_job_tokens: int  # placeholder tokens a new job packs (the first image always goes in)
    # Images whose embeddings are (or, by the time the runner reaches this step, will be)
    # in the runner's encoder cache.
    ready: set[str] = field(default_factory=set)
    _jobs: dict[int, _Job] = field(default_factory=dict)  # oldest first: slices go in order
    _job_of: dict[str, int] = field(default_factory=dict)
    _wanted: dict[str, ImageFeature] = field(default_factory=dict)  # reached this step, no job yet
    _wanters: dict[str, set[str]] = field(default_factory=dict)
    _cancelled: list[int] = field(default_factory=list)
    _next_job_id: int = 0

    @property
    def busy(self) -> bool:
        """Whether encoder work is under way (steps must keep coming to run it)."""
        return bool(self._jobs)

    def units_of(self, image: ImageFeature) -> int:
        rows = self.slicing.rows_per_image or image.tensors["pixel_values"].shape[0]
        return rows * self.slicing.num_passes

    def fit(self, seq_id: str, images: Sequence[ImageFeature], start: int, num_new: int) -> int:
        """The tokens of [start, start + num_new) this step may compute: up to the first
        image they reach whose embeddings are not ready. Every such image in the range is
        wanted, so that later images encode while the earlier ones' tokens are prefilled."""
        fitted = num_new
        for image in sorted(images, key=lambda f: f.offset):
            if image.offset >= start + num_new:
                break
            # An image whose first token is computed had its embeddings; the runner encodes
            # one the cache dropped since whole (EncoderCache.get).
            if image.offset < start or image.image_hash in self.ready:
                continue
            job_id = self._job_of.get(image.image_hash)
            if job_id is not None:
                self._jobs[job_id].owners.add(seq_id)
            else:
                self._wanted.setdefault(image.image_hash, image)
                self._wanters.setdefault(image.image_hash, set()).add(seq_id)
            fitted = min(fitted, image.offset - start)
        return fitted

    def release(self, seq_id: str) -> None:
        """A sequence stops waiting (finished, aborted or preempted): jobs left with no one
        waiting are cancelled."""
        for wanters in self._wanters.values():
            wanters.discard(seq_id)
        for job in list(self._jobs.values()):
            job.owners.discard(seq_id)
            if not job.owners:
                del self._jobs[job.job_id]
                for image_hash in job.hashes:
                    del self._job_of[image_hash]
                if job.started:
                    self._cancelled.append(job.job_id)

    def forget(self, image_hashes: Iterable[str]) -> None:
        """Images the runner's encoder cache dropped: encoded again when next wanted."""
        self.ready.difference_update(image_hashes)

    def take_cancelled(self) -> list[int]:
        cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def take_step(self) -> list[EncoderSlice]:
        """This step's slices: first a new job of the images it reached, then up to the
        budget of row-passes over the jobs, oldest first."""
        self._start_job()
        slices: list[EncoderSlice] = []
        group = self.slicing.rows_per_group
        left = self.slicing.budget_per_step
        for job in list(self._jobs.values()):
            if left < group and slices:
                break
            # Whole merge groups; the first slice of a step takes one group at least, so a
            # budget below a group still progresses.
            num = min(job.total_units - job.done_units, max(group, left // group * group))
            slices.append(EncoderSlice(job.job_id, num, [] if job.started else job.images))
            job.started = True
            job.done_units += num
            left -= num
            if job.done_units == job.total_units:
                del self._jobs[job.job_id]
                for image_hash in job.hashes:
                    del self._job_of[image_hash]
                self.ready.update(job.hashes)
        return slices

    def _start_job(self) -> None:
        images: list[ImageFeature] = []
        owners: set[str] = set()
        tokens = 0
        for image_hash, image in self._wanted.items():
            if images and tokens + image.length > self.max_job_tokens:
                break  # wanted again by a later step
            if not self._wanters[image_hash]:
                continue  # its sequences were preempted in this step
            images.append(image)
            owners |= self._wanters[image_hash]
            tokens += image.length
        self._wanted.clear()
        self._wanters.clear()
        if images:
            job = _Job(self._next_job_id, images, sum(self.units_of(image) for image in images), owners)
            self._next_job_id += 1
            self._jobs[job.job_id] = job
            for image_hash in job.hashes:
                self._job_of[image_hash] = job.job_id
