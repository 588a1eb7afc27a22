"""What a request carries of each image: plain, picklable data that crosses to the
engine core and the model runner with the request."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image


@dataclass
class ImageFeature:
    """One image of a prompt: where its placeholder tokens are and what its encoder reads."""

    image_hash: str  # of the decoded pixels: equal images share encoder output and KV
    offset: int  # index of its first placeholder token in the prompt
    length: int  # its placeholder tokens (the embeddings the encoder produces)
    # The image processor's tensors: pixel_values, and image_grid_thw for Qwen2-VL.
    tensors: dict[str, torch.Tensor]

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def grid_thw(self) -> tuple[int, int, int] | None:
        grid = self.tensors.get("image_grid_thw")
        return None if grid is None else tuple(int(v) for v in grid.reshape(-1))  # type: ignore[return-value]


def hash_image(image: Image.Image) -> str:
    """Content hash of an image as decoded (mode, size and pixels), not of its file bytes:
    the same picture sent as PNG and as a data URL keys the same cache entries."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_hashes_in(features: Sequence[ImageFeature], start: int, end: int) -> tuple[str, ...]:
    """Hashes of the images whose placeholder tokens overlap prompt positions [start, end):
    what a KV block over those positions depends on besides its token ids."""
    return tuple(f.image_hash for f in features if f.offset < end and start < f.end)
