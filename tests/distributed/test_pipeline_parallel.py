"""Pipeline parallelism on real gloo process groups: stages of consecutive layers generate
the one-process tokens, alone and with tensor parallelism inside every stage, with as many
steps in flight as there are stages."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import load_model
from kvserve.model_executor.pipeline_parallel import stage_layers
from tests.conftest import save_tokenizer
from tests.distributed.test_tensor_parallel import _save_tiny, _spawned_children


def test_stage_layers_split_evenly_or_as_told(monkeypatch):
    assert stage_layers(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert stage_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    monkeypatch.setenv("KVSERVE_PP_LAYER_PARTITION", "1,4,2")
    assert stage_layers(7, 3) == [(0, 1), (1, 5), (5, 7)]
    monkeypatch.setenv("KVSERVE_PP_LAYER_PARTITION", "4,4")
    with pytest.raises(ValueError, match="needs 2 positive layer counts that add up to the model's 7 layers"):
        stage_layers(7, 2)
    monkeypatch.delenv("KVSERVE_PP_LAYER_PARTITION")
    with pytest.raises(ValueError, match="pipeline_parallel_size=8 exceeds the model's 7 layers"):
        stage_layers(7, 8)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(("tied", "tp", "pp"), [
    pytest.param(True, 1, 2, id="tied-pp2", marks=pytest.mark.slow),
    pytest.param(False, 1, 3, id="untied-pp3", marks=pytest.mark.slow),
    pytest.param(False, 2, 2, id="tp2-pp2"),
])
def test_stages_generate_the_one_process_tokens(tmp_path_factory, tied, tp, pp):
    model_dir = _save_tiny(tmp_path_factory, num_hidden_layers=3, tie_word_embeddings=tied)
    prompts = [{"prompt_token_ids": [(11 * i + j) % 250 for j in range(5 + 8 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32)
    expected = _tokens(LLM(model_dir, **kwargs), prompts, params)
    llm = LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **kwargs)
    try:
        assert _tokens(llm, prompts, params) == expected
        # The prompts' chunks fill one step per stage before the first one is back.
        assert llm.engine.core.most_batches_in_flight == pp
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # tp2-pp2 above runs two steps at once by default; this adds forks in flight
def test_two_stages_run_two_steps_at_once(tmp_path_factory):
    """Steps are submitted while earlier ones are still in the stages, never two holding one
    sequence: greedy and seeded samples (a prompt forking into two samples in flight) are
    the one-process ones."""
    model_dir = _save_tiny(tmp_path_factory, num_hidden_layers=2)
    prompts = [{"prompt_token_ids": [(13 * i + j) % 250 for j in range(3 + 7 * i)]} for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=24)

    def generate(llm: LLM) -> list[list[list[int]]]:
        outputs = llm.generate(prompts + prompts[:1], [greedy] * len(prompts) + [seeded])
        return [[sample.token_ids for sample in output.outputs] for output in outputs]

    expected = generate(LLM(model_dir, **kwargs))
    llm = LLM(model_dir, pipeline_parallel_size=2, **kwargs)
    try:
        assert generate(llm) == expected
        core = llm.engine.core
        assert core.most_batches_in_flight == 2
        assert not core.has_unfinished_requests()
    finally:
        llm.engine.shutdown()


def _save_qwen2_5_0_5b_shape(directory: str) -> str:
    """Random weights in Qwen2.5-0.5B's shape (kvserve's dummy init) as a bf16 safetensors
    directory: 14 heads over 2 KV heads, QKV bias, 24 layers, a tied 151936-row vocabulary."""
    model = load_model(None, load_format="dummy", model_shape="qwen2.5-0.5b", dtype=torch.float32).model
    tensors = {name: view.to(torch.bfloat16).contiguous() for name, view in model.hf_weight_views().items()}
    del model
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=32768, tie_word_embeddings=True,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(directory)
    save_tokenizer(directory, 151936)
    return directory


@pytest.mark.slow
def test_qwen2_5_0_5b_shape_on_two_stages_of_two_ranks(tmp_path):
    model_dir = _save_qwen2_5_0_5b_shape(str(tmp_path))
    prompts = [{"prompt_token_ids": [(7919 * i + 131 * j) % 151936 for j in range(4 + 5 * i)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, max_num_batched_tokens=64)
    reference = LLM(model_dir, **kwargs)
    expected = _tokens(reference, prompts, params)
    del reference
    llm = LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, **kwargs)
    try:
        assert _tokens(llm, prompts, params) == expected
        assert llm.engine.core.most_batches_in_flight == 2
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_a_dead_stage_fails_the_steps_in_flight_and_nothing_is_left_behind(tmp_path_factory):
    import signal
    import time

    model_dir = _save_tiny(tmp_path_factory, num_hidden_layers=2)
    before = {child.pid for child in _spawned_children()}
    llm = LLM(model_dir, pipeline_parallel_size=2, dtype="float32", kv_cache_memory="4MiB",
              max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(3 + i, 30))}, params)
    engine.step()
    engine.step()
    assert engine.core.most_batches_in_flight == 2
    ranks = [child for child in _spawned_children() if child.pid not in before]
    assert len(ranks) == 2
    ranks[0].send_signal(signal.SIGKILL)  # stage 0, while its steps are in the pipeline
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel .*rank 0 exited \(code -9\)"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    engine.shutdown()
    for rank in ranks:
        rank.wait(timeout=15)
