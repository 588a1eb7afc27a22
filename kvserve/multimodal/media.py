"""Images from the URLs a chat request names: data: URLs always, file:// paths only
inside the allowed directory, http(s) only when remote media is allowed. Every refusal
is a ValueError naming the problem (a 400 before anything is queued)."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP")
# Larger images are refused before decoding (a decompression bomb guard), and so are
# downloads or data URLs larger than this many bytes.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
MAX_IMAGE_BYTES = 32 * 1024 * 1024
REMOTE_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False


def decode_image(data: bytes, source: str) -> Image.Image:
    """A PNG, JPEG or WebP image, fully decoded (a truncated file fails here, not later)."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image {source}: {len(data)} bytes, more than the {MAX_IMAGE_BYTES} allowed")
    try:
        image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"image {source}: {image.width}x{image.height} pixels, more than "
                             f"{MAX_IMAGE_PIXELS} allowed")
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"image {source}: cannot decode it as {', '.join(SUPPORTED_FORMATS)}") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"image {source}: cannot decode it ({e})") from None
    return image


def _from_data_url(url: str) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("image data: URL must be data:image/<format>;base64,<data>")
    media_type = header.removeprefix("data:").removesuffix(";base64").lower()
    if media_type not in ("image/png", "image/jpeg", "image/jpg", "image/webp"):
        raise ValueError(f"image data: URL has media type {media_type!r}; supported: image/png, "
                         "image/jpeg, image/webp")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image data: URL is not valid base64") from None
    return decode_image(data, "in the data: URL")


def _from_file_url(url: str, policy: MediaPolicy) -> Image.Image:
    if policy.allowed_local_media_path is None:
        raise ValueError("file:// image URLs are not allowed (the server has no --allowed-local-media-path)")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    allowed = os.path.realpath(policy.allowed_local_media_path)
    if os.path.commonpath([path, allowed]) != allowed:
        raise ValueError(f"image {url}: outside the allowed local media path")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"image {url}: cannot read it ({e.strerror})") from None
    return decode_image(data, url)


def _from_remote_url(url: str, policy: MediaPolicy) -> Image.Image:
    if not policy.allow_remote_media:
        raise ValueError(f"image {url}: remote image URLs are not fetched (the server runs "
                         "without --allow-remote-media)")
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_SECONDS) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (OSError, ValueError) as e:
        raise ValueError(f"image {url}: cannot fetch it ({e})") from None
    return decode_image(data, url)


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        return _from_data_url(url)
    if scheme == "file":
        return _from_file_url(url, policy)
    if scheme in ("http", "https"):
        return _from_remote_url(url, policy)
    raise ValueError(f"image URL scheme {scheme!r} is not supported (data:, file://, http(s)://)")
