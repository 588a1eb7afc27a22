"""Vision encoder outputs kept per image hash, so that an image is encoded once however
its placeholder tokens are split across prefill chunks, whether its sequence is preempted
and recomputed, and however many requests send it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvserve.multimodal.inputs import ImageFeature


class EncoderCache:
    """Least recently used first out, within `capacity_tokens` embeddings rows; what a
    step needs is never evicted by that step (an entry larger than the whole capacity
    stays until the next step needs room)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_cached_tokens = 0
        # Counters the engine reports: images encoded, and the seconds spent encoding.
        self.num_images_encoded = 0
        self.encoder_seconds = 0.0
        self._evicted: list[str] = []  # since take_evicted: the scheduler's view of what is ready

    def __contains__(self, image_hash: str) -> bool:
        return image_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, features: Sequence[ImageFeature],
            encode: Callable[[list[dict[str, torch.Tensor]]], list[torch.Tensor]],
            sync: Callable[[], None] = lambda: None) -> dict[str, torch.Tensor]:
        """The embeddings of each image in `features`, encoding the missing ones in one
        batched call. `sync`: waits for the device, so that the encoder time is measured."""
        missing: dict[str, ImageFeature] = {}
        for feature in features:
            if feature.image_hash in self._entries:
                self._entries.move_to_end(feature.image_hash)
            else:
                missing.setdefault(feature.image_hash, feature)
        if missing:
            start = time.perf_counter()
            embeddings = encode([feature.tensors for feature in missing.values()])
            sync()
            self.encoder_seconds += time.perf_counter() - start
            self.num_images_encoded += len(missing)
            for feature, embedding in zip(missing.values(), embeddings, strict=True):
                self._insert(feature, embedding)
        wanted = {feature.image_hash for feature in features}
        self._evict(keep=wanted)
        return {image_hash: self._entries[image_hash] for image_hash in wanted}

    def put(self, features: Sequence[ImageFeature], embeddings: Sequence[torch.Tensor]) -> None:
        """Embeddings encoded elsewhere (a sliced encoder job that finished)."""
        for feature, embedding in zip(features, embeddings, strict=True):
            self._insert(feature, embedding)
        self._evict(keep={feature.image_hash for feature in features})

    def take_evicted(self) -> list[str]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def _insert(self, feature: ImageFeature, embedding: torch.Tensor) -> None:
        if embedding.shape[0] != feature.length:
            raise ValueError(f"image {feature.image_hash}: the encoder produced {embedding.shape[0]} "
                             f"embeddings for {feature.length} placeholder tokens")
        previous = self._entries.pop(feature.image_hash, None)
        if previous is not None:
            self.num_cached_tokens -= previous.shape[0]
        self._entries[feature.image_hash] = embedding
        self.num_cached_tokens += embedding.shape[0]

    def _evict(self, keep: set[str]) -> None:
        for image_hash in list(self._entries):
            if self.num_cached_tokens <= self.capacity_tokens:
                break
            if image_hash not in keep:
                self.num_cached_tokens -= self._entries.pop(image_hash).shape[0]
                self._evicted.append(image_hash)
