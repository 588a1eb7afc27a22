"""A vision-language model behind the OpenAI server, driven by the openai client: base64
images in chat, streaming, usage that counts image tokens, image metrics, and every bad
image input answered 400 before anything is queued."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from server_process import launch_server

from tests.vision_models import drawn_images, num_image_tokens, save_model

MODEL = "tiny-vl"
MAX_MODEL_LEN = 48


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "t20 t21"}, *parts]}]


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    directory, _ = save_model("qwen2_vl", str(root / "model"))
    allowed = root / "allowed"
    allowed.mkdir()
    drawn_images()[2].save(allowed / "text.png")
    drawn_images()[0].save(root / "outside.png")
    proc = launch_server(root, "--model", directory, "--served-model-name", MODEL, "--max-model-len",
                         str(MAX_MODEL_LEN), "--limit-mm-per-prompt", "image=3",
                         "--allowed-local-media-path", str(allowed))
    yield proc, directory, root
    proc.stop()


@pytest.fixture(scope="module")
def reference(vl_server):
    from kvserve import LLM

    _, directory, root = vl_server
    return LLM(model=directory, kv_cache_memory="8MiB", max_model_len=MAX_MODEL_LEN,
               allowed_local_media_path=str(root / "allowed"))


def test_chat_with_images_matches_the_offline_engine_streamed_or_not(vl_server, reference):
    from kvserve import SamplingParams

    server, _, root = vl_server
    images = drawn_images()
    messages = user(image_part(data_url(images[0])), image_part(data_url(images[1], "JPEG")),
                    image_part(f"file://{root}/allowed/text.png"))
    (expected,) = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    client = server.client()
    before = {name: metric(server, name) for name in
              ("kvserve:prompt_images_total", "kvserve:encoder_images_total", "kvserve:encoder_time_seconds_total")}
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                            extra_body={"ignore_eos": True})
    assert result.choices[0].message.content == expected.outputs[0].text
    # Image tokens count as prompt tokens: the placeholders as the processor expanded them.
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert metric(server, "kvserve:prompt_images_total") - before["kvserve:prompt_images_total"] == 6
    # The second request's images were cached: three images encoded in all.
    assert metric(server, "kvserve:encoder_images_total") - before["kvserve:encoder_images_total"] == 3
    assert metric(server, "kvserve:encoder_time_seconds_total") > before["kvserve:encoder_time_seconds_total"]


def _gif_url() -> str:
    buffer = io.BytesIO()
    drawn_images()[0].save(buffer, format="GIF")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("parts, message", [
    ([image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())], "cannot decode"),
    ([image_part(_gif_url())], "cannot decode it as PNG, JPEG, WEBP"),
    ([image_part("data:image/gif;base64,R0lGODlh")], "media type 'image/gif'"),
    ([image_part("data:image/png;base64,@@@")], "not valid base64"),
    ([image_part(data_url(Image.new("RGB", (8, 8))))] * 4, "at most 3 image"),
    ([image_part(data_url(Image.new("RGB", (600, 600), "blue")))] * 3, "maximum context length"),
    ([image_part("http://127.0.0.1:9/cat.png")], "--allow-remote-media"),
    ([image_part("file:///etc/passwd")], "outside the allowed local media path"),
    ([image_part("ftp://example.com/cat.png")], "scheme 'ftp'"),
])
def test_bad_images_are_answered_400_and_the_server_goes_on(vl_server, parts, message):
    server, _, root = vl_server
    client = server.client()
    waiting_before = metric(server, "kvserve:prompt_images_total")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=user(*parts), max_tokens=2)
    assert message in str(error.value)
    assert metric(server, "kvserve:prompt_images_total") == waiting_before  # nothing was queued
    result = client.chat.completions.create(model=MODEL, messages=user(image_part(data_url(drawn_images()[1]))),
                                            max_tokens=2)
    assert result.usage.completion_tokens == 2


def test_path_escaping_the_allowed_directory_is_refused(vl_server):
    server, _, root = vl_server
    with pytest.raises(openai.BadRequestError, match="outside the allowed"):
        server.client().chat.completions.create(
            model=MODEL, messages=user(image_part(f"file://{root}/allowed/../outside.png")), max_tokens=2)


def test_bench_serve_random_mm_sends_images_the_usage_counts(vl_server, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    server, _, _ = vl_server
    output = tmp_path / "result.json"
    code = main(["--log-level", "WARNING", "bench", "serve", "--base-url", server.base_url, "--endpoint", "chat",
                 "--dataset", "random-mm", "--images-per-request", "2", "--image-size", "64x48",
                 "--num-prompts", "3", "--input-len", "4", "4", "--output-len", "3", "3",
                 "--random-token-range", "5", "300", "--output-json", str(output)])
    assert code == 0, capsys.readouterr().out
    run = json.loads(output.read_text())
    assert run["completed"] == 3 and run["failed"] == 0
    assert run["images_per_request"] == 2 and run["image_size"] == "64x48"
    # Each image's placeholder tokens (as the transformers processor expands them) between
    # vision start and end, besides the text and the template's 5 ("t3 user ... t4 t3 assistant")
    # (exact usage counts are checked above; the detokenized random text retokenizes unevenly).
    per_image = num_image_tokens("qwen2_vl", Image.new("RGB", (64, 48)))
    assert all(r["prompt_tokens"] > 5 + 2 * (per_image + 2) for r in run["requests"])
