"""OpenAI chat messages whose content mixes text and image parts, turned into what a chat
template reads (text, each image replaced by the model's placeholder text) and the images
in order."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from PIL import Image

from kvserve.multimodal.media import MediaPolicy, load_image


def _image_url(part: dict[str, Any]) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url content part needs image_url.url")
    return url


def split_images(messages: Iterable[dict[str, Any]], placeholder_text: str | None, policy: MediaPolicy,
                 max_images: int) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """(messages with string content, the images in message order). `placeholder_text`
    None: the model takes no images, and an image part is an error. The image count is
    checked before any image is loaded."""
    converted: list[dict[str, Any]] = []
    image_parts: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            converted.append(message)
            continue
        pieces: list[str] = []
        num_before = len(image_parts)
        for part in content:
            kind = part.get("type")
            if kind == "text":
                pieces.append(part["text"])
            elif kind == "image_url":
                if placeholder_text is None:
                    raise ValueError("this model does not take images (image_url content parts)")
                image_parts.append(part)
                pieces.append(placeholder_text)
            else:
                raise ValueError(f"content part type {kind!r} is not supported (text, image_url)")
        converted.append({**message, "content": "".join(pieces) if len(image_parts) > num_before else "\n".join(pieces)})
    if len(image_parts) > max_images:
        raise ValueError(f"at most {max_images} image(s) per prompt are allowed (--limit-mm-per-prompt), "
                         f"got {len(image_parts)}")
    return converted, [load_image(_image_url(part), policy) for part in image_parts]
