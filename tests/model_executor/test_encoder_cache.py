"""The encoder cache: each image hash encoded once, missing images encoded in one batched
call, least recently used entries evicted beyond the capacity, never one a step needs."""

from __future__ import annotations

import torch

from kvserve.model_executor.encoder_cache import EncoderCache
from kvserve.multimodal.inputs import ImageFeature


def _feature(name: str, length: int) -> ImageFeature:
    return ImageFeature(name, 0, length, {"pixel_values": torch.full((1,), float(length))})


class CountingEncoder:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        self.batches.append(len(images))
        return [torch.ones(int(image["pixel_values"].item()), 4) for image in images]


def test_each_image_is_encoded_once_and_missing_ones_in_one_batch():
    cache, encoder = EncoderCache(capacity_tokens=100), CountingEncoder()
    a, b, c = _feature("a", 5), _feature("b", 6), _feature("c", 7)
    assert set(cache.get([a, b, a], encoder)) == {"a", "b"}
    cache.get([a, b, c], encoder)
    assert encoder.batches == [2, 1]
    assert cache.num_images_encoded == 3


def test_least_recently_used_is_evicted_but_not_what_the_step_needs():
    cache, encoder = EncoderCache(capacity_tokens=10), CountingEncoder()
    a, b, c = _feature("a", 4), _feature("b", 4), _feature("c", 4)
    cache.get([a], encoder)
    cache.get([b], encoder)
    cache.get([a], encoder)  # a is now the most recent
    cache.get([c], encoder)  # 12 > 10: b goes
    assert "a" in cache and "c" in cache and "b" not in cache
    big = _feature("big", 20)  # larger than the capacity: kept for the step that needs it
    assert cache.get([big], encoder)["big"].shape[0] == 20
    assert len(cache) == 1 and cache.num_cached_tokens == 20
