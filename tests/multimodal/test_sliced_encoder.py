"""The vision tower spread over steps (--encoder-budget-per-step): the sliced tower's
embeddings equal transformers', every step runs exactly its budget of row-passes while the
text streams keep decoding, the tokens equal those of whole-image encoding (and
transformers'), and an aborted or preempted request's partial encoder state is dropped."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.models import qwen_vision_slices
from tests.vision_models import build_model, drawn_images, hf_inputs, image_processor, qwen_image_prompt, save_model

KIND = "qwen2_vl"
DEPTH = 2  # tests/vision_models.py's towers
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_model(KIND, str(tmp_path_factory.mktemp(KIND)))


def _request(prompt: list[int], images) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}


def _hf_ids(model, prompt: list[int], images, num_tokens: int) -> list[int]:
    inputs = hf_inputs(KIND, prompt, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _num_rows(images) -> int:
    return int(image_processor(KIND)(images=images, return_tensors="pt")["pixel_values"].shape[0])


@pytest.mark.parametrize("kind", ["llava", "llava_siglip"])
@pytest.mark.parametrize("slice_units", [1, 7, 100, 10**6])
def test_sliced_llava_tower_matches_transformers(kind, slice_units):
    """CLIP (features: the second-to-last layer, class token dropped) and SigLIP (the last
    layer, every patch), three images in one batch, against transformers' tower and
    projector."""
    from kvserve.model_executor.models import llava_vision_slices
    from kvserve.model_executor.models.vision_language import _llava_feature_layers

    model = build_model(kind)
    tower, projector, config = model.model.vision_tower, model.model.multi_modal_projector, model.config
    pixels = image_processor(kind)(images=drawn_images(), return_tensors="pt")["pixel_values"]
    skip = 1 if config.vision_feature_select_strategy == "default" else 0
    with torch.no_grad():
        hidden_states = tower(pixels, output_hidden_states=True).hidden_states
        expected = projector(hidden_states[config.vision_feature_layer][:, skip:])
        state = llava_vision_slices.begin(tower, pixels, _llava_feature_layers(config), skip,
                                          projector.linear_2.out_features)
        runs = []
        while not state.finished:
            runs.append(llava_vision_slices.advance(tower, projector, state, slice_units))
        embeddings = llava_vision_slices.result(state)
    rows = 3 * (16 + skip)
    # The embeddings' pass, then the layers up to the features' (past them none runs).
    total = rows * (config.vision_feature_layer % len(hidden_states) + 1)
    assert state.total_units == total
    assert runs == [slice_units] * (total // slice_units) + ([total % slice_units] if total % slice_units else [])
    torch.testing.assert_close(torch.stack(embeddings), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("slice_units", [4, 12, 100, 10**6])
def test_sliced_tower_matches_transformers(kind, slice_units):
    """Three images of different grids packed in one batch (Qwen2.5-VL: window attention in
    block 0, full in block 1), run a slice at a time, against transformers' whole tower."""
    visual = build_model(kind).model.visual
    inputs = image_processor(kind)(images=drawn_images(), return_tensors="pt")
    with torch.no_grad():
        expected = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        state = qwen_vision_slices.begin(visual, inputs["pixel_values"], inputs["image_grid_thw"])
        rows = inputs["pixel_values"].shape[0]
        assert state.total_units == rows * (DEPTH + 1)
        runs = []
        while not state.finished:
            runs.append(qwen_vision_slices.advance(visual, state, slice_units))
        embeddings = qwen_vision_slices.result(state)
    total = rows * (DEPTH + 1)
    assert runs == [slice_units] * (total // slice_units) + ([total % slice_units] if total % slice_units else [])
    sizes = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
    assert [e.shape[0] for e in embeddings] == sizes
    torch.testing.assert_close(torch.cat(embeddings), expected, rtol=1e-5, atol=1e-5)


def test_a_slice_is_whole_merge_groups():
    visual = build_model(KIND).model.visual
    inputs = image_processor(KIND)(images=drawn_images()[:1], return_tensors="pt")
    state = qwen_vision_slices.begin(visual, inputs["pixel_values"], inputs["image_grid_thw"])
    with pytest.raises(ValueError, match="merge groups"):
        qwen_vision_slices.advance(visual, state, 6)


def _steps(llm: LLM) -> list[dict]:
    """Per executed step: its scheduled tokens, its slices' row-passes, the row-passes the
    runner ran, and the images complete in the encoder cache when its forward began."""
    runner = llm.engine.core.runner
    steps: list[dict] = []
    execute = runner.execute

    def recording(sched):
        before = runner.sliced_encoder.num_units_run
        step = {"tokens": dict(sched.num_scheduled_tokens),
                "granted": sum(piece.num_units for piece in sched.encoder_slices)}
        forward = runner.forward

        def forward_seeing_cache(s):
            step["cached"] = {h for h in list(runner.encoder_cache._entries)}
            return forward(s)

        runner.forward = forward_seeing_cache
        try:
            output = execute(sched)
        finally:
            runner.forward = forward
        step["ran"] = runner.sliced_encoder.num_units_run - before
        steps.append(step)
        return output

    runner.execute = recording
    return steps


@pytest.mark.parametrize("budget", [4, 12, 40])
def test_each_step_runs_its_budget_while_text_streams_decode(qwen, budget):
    directory, hf_model = qwen
    images = drawn_images()
    prompt = qwen_image_prompt(3)
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, encoder_budget_per_step=budget)
    engine = llm.engine
    text = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"text-{i}", list(range(20 + i, 40 + i)), text)
    engine.step()  # the text prompts
    steps = _steps(llm)
    engine.add_request("image", _request(prompt, images), GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids

    total = _num_rows(images) * (DEPTH + 1)
    encoding = [step for step in steps if step["ran"]]
    # One job (the three images reached together), exactly `budget` row-passes a step.
    assert [step["ran"] for step in encoding] == [budget] * (total // budget) + (
        [total % budget] if total % budget else [])
    assert all(step["ran"] == step["granted"] for step in steps)
    assert llm.engine.core.runner.encoder_cache.num_images_encoded == 3
    # Both text streams decode in every step that encodes.
    assert all({"text-0#0", "text-1#0"} <= set(step["tokens"]) for step in encoding)
    # No placeholder token is computed before its image's embeddings are complete.
    prepared = llm.engine.prepare_prompt(_request(prompt, images))
    computed = 0
    for step in steps:
        num = sum(n for seq_id, n in step["tokens"].items() if not seq_id.startswith("text"))
        for feature in prepared.mm_features:
            if computed < feature.end and feature.offset < computed + num:
                assert feature.image_hash in step["cached"]
        computed += num
    assert outputs["image"] == _hf_ids(hf_model, prompt, images, GREEDY.max_tokens)


def test_tokens_equal_whole_image_encoding(qwen):
    """Image requests beside text streams: the same greedy tokens with the tower whole or
    sliced, and as transformers' (two requests share an image: encoded once)."""
    directory, hf_model = qwen
    images = drawn_images()
    requests = [_request(qwen_image_prompt(2), images[:2]), list(range(30, 60)), _request(qwen_image_prompt(1, lead=5), images[2:]),
                list(range(60, 75)), _request(qwen_image_prompt(1, lead=2), images[:1])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = {}
    for budget in (0, 4, 24):
        llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=16,
                  encoder_budget_per_step=budget)
        results[budget] = [output.outputs[0].token_ids for output in llm.generate(requests, params)]
        assert llm.engine.core.runner.encoder_cache.num_images_encoded == 3
        assert (llm.engine.core.runner.sliced_encoder.num_units_run > 0) == (budget > 0)
    assert results[4] == results[0]
    assert results[24] == results[0]
    expected = [_hf_ids(hf_model, r["prompt_token_ids"], r["multi_modal_data"]["image"], 12) if isinstance(r, dict)
                else _hf_ids(hf_model, r, [], 12) for r in requests]
    assert results[4] == expected


def test_abort_mid_encoding_drops_the_partial_state(qwen):
    directory, _ = qwen
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, encoder_budget_per_step=4)
    engine, runner = llm.engine, llm.engine.core.runner
    engine.add_request("text", list(range(20, 40)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("image", _request(qwen_image_prompt(3), drawn_images()), GREEDY)
    for _ in range(3):
        engine.step()
    assert len(runner.sliced_encoder) == 1 and engine.core.scheduler.encoder_slicer.busy
    engine.abort_request("image")
    engine.step()  # the next step tells the runner
    assert len(runner.sliced_encoder) == 0 and not engine.core.scheduler.encoder_slicer.busy
    # Alone: the engine goes idle, and the runner is told at once.
    engine.add_request("image-2", _request(qwen_image_prompt(3), drawn_images()), GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("text")
    assert len(runner.sliced_encoder) == 1
    engine.abort_request("image-2")
    assert len(runner.sliced_encoder) == 0
    assert runner.encoder_cache.num_images_encoded == 0


def test_preemption_mid_encoding_drops_the_partial_state_and_recomputes(qwen):
    """A text stream's growth preempts the image request (the latest admitted) while its
    images are being encoded; the job is dropped, and the request encodes again and matches
    transformers."""
    directory, hf_model = qwen
    images = drawn_images()
    prompt = qwen_image_prompt(3)
    # 12 blocks of 16 tokens: the stream's 192 tokens take all of them.
    llm = LLM(model=directory, kv_cache_memory="96KiB", max_model_len=192, enable_prefix_caching=False,
              encoder_budget_per_step=4)
    engine, runner = llm.engine, llm.engine.core.runner
    engine.add_request("text", list(range(20, 40)), SamplingParams(temperature=0.0, max_tokens=172, ignore_eos=True))
    engine.step()
    while engine.core.scheduler.running[0].num_tokens < 171:
        engine.step()  # 11 blocks held
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("image", _request(prompt, images), params)
    preempted_with_job = False
    outputs = {}
    while engine.has_unfinished_requests():
        jobs_before = len(runner.sliced_encoder)
        preemptions = engine.stats().num_preemptions
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        if engine.stats().num_preemptions > preemptions and jobs_before:
            preempted_with_job = True
            assert len(runner.sliced_encoder) == 0  # dropped in the step that preempted it
    assert preempted_with_job
    assert outputs["image"] == _hf_ids(hf_model, prompt, images, 4)
    assert runner.encoder_cache.num_images_encoded == 3


def test_the_budget_flag_per_device_and_model(qwen, tmp_path):
    import argparse

    from kvserve.engine.engine_args import CPU_ENCODER_BUDGET_PER_STEP, EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    default = EngineArgs.from_cli_args(parser.parse_args([]))
    assert default.resolved_encoder_budget_per_step(cpu) == CPU_ENCODER_BUDGET_PER_STEP
    assert default.resolved_encoder_budget_per_step(gpu) == 0  # whole images: the GPU path as it was
    chosen = EngineArgs.from_cli_args(parser.parse_args(["--encoder-budget-per-step", "32"]))
    assert chosen.resolved_encoder_budget_per_step(gpu) == 32
    with pytest.raises(ValueError, match="encoder_budget_per_step"):
        EngineArgs(encoder_budget_per_step=-1).resolved_encoder_budget_per_step(cpu)
    # LLaVA (CLIP): 16 patches and the class token per image, through the embeddings and
    # layer 0 (its features are the second-to-last of 2 layers' hidden states).
    llava, _ = save_model("llava", str(tmp_path / "llava"))
    slicing = LLM(model=llava, kv_cache_memory="8MiB", max_model_len=256).engine.core.scheduler_config.encoder_slicing
    assert (slicing.num_passes, slicing.rows_per_group, slicing.rows_per_image) == (2, 1, 17)
    directory, _ = qwen
    assert LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256,
               encoder_budget_per_step=0).engine.core.scheduler.encoder_slicer is None
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256)
    slicing = llm.engine.core.scheduler_config.encoder_slicing
    assert (slicing.budget_per_step, slicing.num_passes, slicing.rows_per_group) == (
        CPU_ENCODER_BUDGET_PER_STEP, DEPTH + 1, 4)


@pytest.mark.parametrize("kind", ["llava", "llava_siglip"])
def test_llava_engine_tokens_sliced_equal_transformers(kind, tmp_path):
    from tests.vision_models import LLAVA_IMAGE

    directory, hf_model = save_model(kind, str(tmp_path / kind))
    images = drawn_images()[:2]
    prompt = [1, 10, 11, LLAVA_IMAGE, 20, LLAVA_IMAGE, 21, 30]
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=256, encoder_budget_per_step=5)
    steps = _steps(llm)
    (output,) = llm.generate([_request(prompt, images)], GREEDY)
    inputs = hf_inputs(kind, prompt, images)
    with torch.no_grad():
        expected = hf_model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert output.outputs[0].token_ids == expected
    slicing = llm.engine.core.scheduler_config.encoder_slicing
    assert all(step["ran"] <= 5 for step in steps)
    assert sum(step["ran"] for step in steps) == 2 * slicing.rows_per_image * slicing.num_passes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("start", "end"), [(0, 100), (3, 60), (38, 39), (40, 100), (5, 37)])
def test_gpu_varlen_segment_attention_equals_attention_per_segment(start, end):
    """One variable-length call for rows [start, end) (a slice may cut segments) against
    fp32 attention of each row over its own segment's keys."""
    from kvserve.model_executor.models.vision_slices import segment_attention

    segments = [0, 5, 37, 40, 100]
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 100, 4, 80, generator=generator)
    scale = 80**-0.5
    expected = []
    for row in range(start, end):
        segment = max(i for i, s in enumerate(segments[:-1]) if s <= row)
        keys = slice(segments[segment], segments[segment + 1])
        weights = torch.softmax(torch.einsum("hd,khd->hk", qkv[0, row], qkv[1, keys]) * scale, dim=-1)
        expected.append(torch.einsum("hk,khd->hd", weights, qkv[2, keys]).reshape(-1))
    got = segment_attention(qkv.cuda().bfloat16(), segments, start, end, scale)
    torch.testing.assert_close(got.float().cpu(), torch.stack(expected), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_gpu_bf16_tower_matches_transformers_fp32(kind, tmp_path):
    """encode_images on CUDA (the sliced pass in one go, varlen attention) in bf16 against
    transformers' tower in fp32 on the same weights."""
    directory, hf_model = save_model(kind, str(tmp_path))
    llm = LLM(model=directory, device="cuda", dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=256)
    inputs = image_processor(kind)(images=drawn_images(), return_tensors="pt")
    visual = hf_model.model.visual.cuda()
    with torch.no_grad():
        expected = visual(inputs["pixel_values"].cuda(), grid_thw=inputs["image_grid_thw"].cuda()).pooler_output
        images = [{"pixel_values": p, "image_grid_thw": g[None]} for p, g in zip(
            inputs["pixel_values"].split((inputs["image_grid_thw"].prod(-1)).tolist()), inputs["image_grid_thw"])]
        got = torch.cat(llm.engine.core.runner.model.encode_images(images))
    assert got.dtype == torch.bfloat16
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert error < 2e-2, error
