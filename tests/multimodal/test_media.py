"""Image URLs under the media policy: data: URLs in each supported format, file:// only
inside the allowed directory, http(s) only when remote media is allowed (against a local
HTTP server), and the image hash that keys the encoder and prefix caches."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import pytest
from PIL import Image

from kvserve.multimodal.inputs import hash_image
from kvserve.multimodal.media import MediaPolicy, load_image
from tests.vision_models import drawn_images


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt, media_type", [("PNG", "png"), ("WEBP", "webp"), ("JPEG", "jpeg")])
def test_data_urls_decode_each_supported_format(fmt, media_type):
    image = drawn_images()[1]
    options = {"lossless": True} if fmt == "WEBP" else {}
    url = f"data:image/{media_type};base64," + base64.b64encode(_encoded(image, fmt, **options)).decode()
    loaded = load_image(url, MediaPolicy())
    assert loaded.size == image.size
    if fmt != "JPEG":  # lossless: the same pixels, so the same hash
        assert hash_image(loaded.convert("RGB")) == hash_image(image)


def test_truncated_image_is_refused():
    data = _encoded(drawn_images()[1], "PNG")[:200]
    with pytest.raises(ValueError, match="cannot decode"):
        load_image("data:image/png;base64," + base64.b64encode(data).decode(), MediaPolicy())


def test_file_urls_only_inside_the_allowed_directory(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    drawn_images()[0].save(allowed / "a.png")
    drawn_images()[0].save(tmp_path / "b.png")
    (allowed / "link.png").symlink_to(tmp_path / "b.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed}/a.png", policy).size == (80, 60)
    for url in (f"file://{tmp_path}/b.png", f"file://{allowed}/../b.png", f"file://{allowed}/link.png"):
        with pytest.raises(ValueError, match="outside the allowed"):
            load_image(url, policy)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        load_image(f"file://{allowed}/a.png", MediaPolicy())
    with pytest.raises(ValueError, match="cannot read"):
        load_image(f"file://{allowed}/missing.png", policy)


@pytest.fixture
def http_server(tmp_path):
    drawn_images()[2].save(tmp_path / "c.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_remote_urls_are_fetched_only_when_allowed(http_server):
    url = f"{http_server}/c.png"
    with pytest.raises(ValueError, match="--allow-remote-media"):
        load_image(url, MediaPolicy())
    loaded = load_image(url, MediaPolicy(allow_remote_media=True))
    assert hash_image(loaded) == hash_image(drawn_images()[2])
    with pytest.raises(ValueError, match="cannot fetch"):
        load_image(f"{http_server}/missing.png", MediaPolicy(allow_remote_media=True))


def test_image_hash_tells_pixels_apart():
    image = drawn_images()[1]
    assert hash_image(image) == hash_image(image.copy())
    assert hash_image(image) != hash_image(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    assert hash_image(image) != hash_image(image.resize((99, 70)))
