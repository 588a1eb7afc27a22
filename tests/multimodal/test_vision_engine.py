"""The engine around a vision-language model: chunked prefill that splits an image's
placeholder tokens, preemption, prefix caching keyed by image, the token budget, the
encoder cache (each image encoded once), and bad inputs refused before queueing."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from kvserve import LLM, SamplingParams
from tests.vision_models import (
    LLAVA_IMAGE, drawn_images, hf_inputs, num_image_tokens, qwen_image_prompt, save_model,
)

KIND = "qwen2_vl"
NUM_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_model(KIND, str(tmp_path_factory.mktemp(KIND)))


def _hf_ids(model, prompt: list[int], images) -> list[int]:
    inputs = hf_inputs(KIND, prompt, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _request(prompt: list[int], images) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}


def _record_steps(llm: LLM) -> list[dict[str, int]]:
    """Each step's scheduled tokens per sequence, as the runner receives them."""
    runner = llm.engine.core.runner
    steps: list[dict[str, int]] = []
    forward = runner.forward

    def recording(sched):
        steps.append(dict(sched.num_scheduled_tokens))
        return forward(sched)

    runner.forward = recording
    return steps


def test_chunked_prefill_splits_image_tokens_and_encodes_each_image_once(qwen):
    directory, hf_model = qwen
    images = drawn_images()
    prompt = qwen_image_prompt(3)
    num_prompt = len(prompt) - 3 + sum(num_image_tokens(KIND, image) for image in images)
    budget = 3  # smaller than every image's placeholder run: each image spans several steps
    assert all(num_image_tokens(KIND, image) > budget for image in images)
    # Images encoded whole in the step that reaches them (test_sliced_encoder.py: spread over steps).
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=budget,
              encoder_budget_per_step=0)
    steps = _record_steps(llm)
    (output,) = llm.generate(_request(prompt, images), GREEDY)
    assert output.outputs[0].token_ids == _hf_ids(hf_model, prompt, images)
    # Image tokens count in the budget: the prompt takes ceil(P / budget) full steps.
    prefill = [sum(step.values()) for step in steps[: -(-num_prompt // budget)]]
    assert prefill == [budget] * (num_prompt // budget) + ([num_prompt % budget] if num_prompt % budget else [])
    assert llm.engine.core.runner.encoder_cache.num_images_encoded == 3
    assert llm.engine.stats().num_images_encoded == 3


def test_preemption_recomputes_without_reencoding(qwen):
    directory, hf_model = qwen
    images = drawn_images()
    prompts = [qwen_image_prompt(1, lead=3 + i) for i in range(4)]
    requests = [_request(p, [images[i % 3]]) for i, p in enumerate(prompts)]
    # 12 blocks of 16 tokens: four ~30-token prompts fit, their growth does not.
    llm = LLM(model=directory, kv_cache_memory="96KiB", max_model_len=128, max_num_batched_tokens=256,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(requests, params)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, request, output in zip(prompts, requests, outputs):
        inputs = hf_inputs(KIND, prompt, request["multi_modal_data"]["image"])
        with torch.no_grad():
            expected = hf_model.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected
    assert llm.engine.core.runner.encoder_cache.num_images_encoded == 3  # distinct images


def test_prefix_cache_shared_for_the_same_image_never_across_images(qwen):
    directory, hf_model = qwen
    image, other = drawn_images()[1], drawn_images()[1].transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # The image starts in the first block, so every full block depends on it.
    prompt = qwen_image_prompt(1, lead=3) + list(range(60, 90))
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, block_size=16)
    stats = llm.engine.core.scheduler.prefix_cache_stats
    llm.generate(_request(prompt, [image]), GREEDY)
    num_tokens = len(prompt) - 1 + num_image_tokens(KIND, image)
    hits_before = stats.hit_tokens
    (same,) = llm.generate(_request(prompt, [image.copy()]), GREEDY)
    assert stats.hit_tokens - hits_before == (num_tokens - 1) // 16 * 16
    hits_before = stats.hit_tokens
    (different,) = llm.generate(_request(prompt, [other]), GREEDY)
    assert stats.hit_tokens == hits_before
    assert same.outputs[0].token_ids == _hf_ids(hf_model, prompt, [image])
    assert different.outputs[0].token_ids == _hf_ids(hf_model, prompt, [other])
    # The repeated image was not encoded again.
    assert llm.engine.core.runner.encoder_cache.num_images_encoded == 2


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def test_chat_with_image_parts_matches_generate_with_pil_images(qwen, tmp_path):
    directory, _ = qwen
    images = drawn_images()
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256,
              allowed_local_media_path=str(tmp_path))
    images[2].save(tmp_path / "text.webp", format="WEBP", lossless=True)
    message = {"role": "user", "content": [
        {"type": "text", "text": "t20 t21"},
        {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
        {"type": "image_url", "image_url": {"url": _data_url(images[1], "JPEG")}},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/text.webp"}},
        {"type": "text", "text": " t22"},
    ]}
    (chat,) = llm.chat([message], GREEDY)
    # The chat template's text, with the model's placeholder text for each image.
    jpeg = Image.open(io.BytesIO(base64.b64decode(_data_url(images[1], "JPEG").partition(",")[2])))
    prompt = ("t3 user t20 t21" + "<|vision_start|><|image_pad|><|vision_end|>" * 3 + " t22 t4 t3 assistant ")
    (direct,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [images[0], jpeg, images[2]]}},
                             GREEDY)
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert len(chat.prompt_token_ids) == len(direct.prompt_token_ids)


@pytest.mark.parametrize("prompt, error", [
    (lambda images: _request(qwen_image_prompt(2), images[:1]), "2 image placeholder"),
    (lambda images: _request(qwen_image_prompt(0), images[:1]), "0 image placeholder"),
    (lambda images: _request(qwen_image_prompt(3), images * 3), "at most 4 image"),
    (lambda images: {"prompt_token_ids": qwen_image_prompt(1), "multi_modal_data": {"image": ["not an image"]}},
     "PIL image"),
    (lambda images: _request(qwen_image_prompt(1), [Image.new("RGB", (600, 600))]), "maximum context length"),
])
def test_bad_image_inputs_are_refused_before_queueing(qwen, prompt, error):
    directory, _ = qwen
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=28, limit_mm_per_prompt={"image": 4})
    with pytest.raises(ValueError, match=error):
        llm.generate(prompt(drawn_images()), GREEDY)
    assert not llm.engine.has_unfinished_requests()
    (output,) = llm.generate(_request(qwen_image_prompt(1), drawn_images()[:1]), GREEDY)  # the engine goes on
    assert len(output.outputs[0].token_ids) == NUM_TOKENS


def test_overlapped_decode_steps_keep_mrope_positions(qwen):
    """Decode steps launched before the host reads their input token (overlapped scheduling,
    the GPU default) rotate by index + M-RoPE offset too."""
    directory, hf_model = qwen
    images = drawn_images()
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, overlap_scheduling=True)
    prompts = [qwen_image_prompt(1), qwen_image_prompt(2, lead=5)]
    outputs = llm.generate([_request(prompts[0], images[:1]), _request(prompts[1], images[1:])], GREEDY)
    assert llm.engine.core.num_steps_ahead > 0
    assert outputs[0].outputs[0].token_ids == _hf_ids(hf_model, prompts[0], images[:1])
    assert outputs[1].outputs[0].token_ids == _hf_ids(hf_model, prompts[1], images[1:])


def test_llava_chunked_prefill_splits_image_tokens(tmp_path):
    directory, hf_model = save_model("llava", str(tmp_path / "llava"))
    images = drawn_images()[:2]
    prompt = [1, 10, 11, LLAVA_IMAGE, 20, LLAVA_IMAGE, 21, 30]
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=5)
    (output,) = llm.generate(_request(prompt, images), GREEDY)
    inputs = hf_inputs("llava", prompt, images)
    with torch.no_grad():
        expected = hf_model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert output.outputs[0].token_ids == expected
    assert llm.engine.core.runner.encoder_cache.num_images_encoded == 2


def test_a_step_starts_encoder_work_within_its_token_budget(qwen):
    """Each step starts images (encodes them whole) only while their placeholder tokens fit
    the step's budget; the chunk ends before an image that does not fit."""
    directory, hf_model = qwen
    images = drawn_images()
    prompt = qwen_image_prompt(3, lead=1)
    # Images of 6, 8 and 4 tokens at offsets 2, 11 and 22: the first 12 tokens would start
    # the first two (14 > 12) without the encoder budget.
    budget = 12
    # Images encoded whole in the step that reaches them (test_sliced_encoder.py: spread over steps).
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=budget,
              encoder_budget_per_step=0)
    steps = _record_steps(llm)
    (output,) = llm.generate(_request(prompt, images), GREEDY)
    assert output.outputs[0].token_ids == _hf_ids(hf_model, prompt, images)
    prepared = llm.engine.prepare_prompt(_request(prompt, images))
    computed = 0
    for step in steps:
        (num,) = step.values()
        started = [f for f in prepared.mm_features if computed <= f.offset < computed + num]
        assert sum(f.length for f in started) <= budget or len(started) == 1
        computed += num
    assert llm.engine.core.runner.encoder_cache.num_images_encoded == 3


@pytest.mark.parametrize("url, error", [
    ("http://127.0.0.1:9/cat.png", "--allow-remote-media"),
    ("file:///etc/hostname", "--allowed-local-media-path"),
    ("data:image/bmp;base64,Qk0=", "media type 'image/bmp'"),
])
def test_offline_chat_refuses_bad_image_urls_before_queueing(qwen, url, error):
    directory, _ = qwen
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=64)
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
    with pytest.raises(ValueError, match=error):
        llm.chat([message], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_compiled_decode_steps_rotate_by_the_mrope_offset(qwen):
    """Past its prompt a Qwen2-VL sequence's three M-RoPE coordinates are equal (its index
    plus the image's delta): its decode steps run in the compiled CPU graphs, and greedy
    ids stay transformers' for sequences with different deltas batched together."""
    directory, hf_model = qwen
    images = drawn_images()
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, compile_decode=True)
    compiled, calls = llm.engine.core.runner.compiled_decode, []
    forward = compiled.forward
    compiled.forward = lambda *args: calls.append(args[1].dim()) or forward(*args)
    prompts = [qwen_image_prompt(1), qwen_image_prompt(2, lead=5), [10, 11, 12]]
    requests = [_request(prompts[0], images[:1]), _request(prompts[1], images[1:]),
                {"prompt_token_ids": prompts[2]}]
    outputs = llm.generate(requests, GREEDY)
    assert outputs[0].outputs[0].token_ids == _hf_ids(hf_model, prompts[0], images[:1])
    assert outputs[1].outputs[0].token_ids == _hf_ids(hf_model, prompts[1], images[1:])
    assert outputs[2].outputs[0].token_ids == _hf_ids(hf_model, prompts[2], [])
    assert len(calls) >= NUM_TOKENS - 1 and set(calls) == {1}


@pytest.mark.gpu
def test_cuda_graph_decode_steps_rotate_by_the_mrope_offset(qwen):
    """The captured decode graphs replay Qwen2-VL's steps with each sequence's M-RoPE delta
    in its rotary positions (not its cache slots): greedy ids as transformers' (fp32, GPU)."""
    directory, hf_model = qwen
    images = drawn_images()
    llm = LLM(model=directory, device="cuda", dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    runner = llm.engine.core.runner
    assert runner.cuda_graphs is not None
    # kv_cache_memory holds on a GPU too (not the free memory at gpu_memory_utilization).
    assert sum(cache.numel() * cache.element_size() for cache in runner.kv_caches) <= 64 * 2**20
    prompts = [qwen_image_prompt(1), qwen_image_prompt(2, lead=5), [10, 11, 12]]
    requests = [_request(prompts[0], images[:1]), _request(prompts[1], images[1:]),
                {"prompt_token_ids": prompts[2]}]
    outputs = llm.generate(requests, GREEDY)
    hf_model = hf_model.to("cuda")
    try:
        for prompt, image_list, output in zip(prompts, [images[:1], images[1:], []], outputs):
            inputs = {k: v.to("cuda") for k, v in hf_inputs(KIND, prompt, image_list).items()}
            with torch.no_grad():
                out = hf_model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
            assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1]:].tolist()
    finally:
        hf_model.to("cpu")
    assert sum(runner.cuda_graphs.replays.values()) >= NUM_TOKENS - 1
