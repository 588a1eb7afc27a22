"""The server fills the sampling values a request leaves unset from the model's
generation_config.json, and keeps every value a request sets: each response equals the
offline engine run with the merged SamplingParams spelled out."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from server_process import launch_server
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams

MODEL = "tiny"
PROMPT = [5, 9, 17, 3, 5, 9]
# Greedy with a strong repetition penalty: requests that leave both unset are greedy and
# penalized; the penalty changes this tiny model's greedy tokens (checked below).
GENERATION = {"do_sample": False, "repetition_penalty": 1.8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tests.conftest import randomize, save_tokenizer

    directory = str(tmp_path_factory.mktemp("generation_config") / "tiny")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    randomize(model, 0)
    model.save_pretrained(directory)
    save_tokenizer(directory, 64)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f)
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = launch_server(tmp_path_factory.mktemp("server_generation_config"), "--model", model_dir,
                         "--served-model-name", MODEL)
    yield proc
    proc.stop()


@pytest.mark.parametrize(("request_values", "merged"), [
    ({}, SamplingParams(temperature=0.0, repetition_penalty=1.8)),
    ({"repetition_penalty": 1.0}, SamplingParams(temperature=0.0, repetition_penalty=1.0)),
    ({"temperature": 0.0, "repetition_penalty": 1.3}, SamplingParams(temperature=0.0, repetition_penalty=1.3)),
])
def test_unset_values_come_from_the_model_and_set_ones_stay(server, model_dir, request_values, merged):
    offline = LLM(model=model_dir, kv_cache_memory="16MiB", generation_config="none")
    merged.max_tokens = 12
    expected = offline.generate({"prompt_token_ids": PROMPT}, merged)[0].outputs[0]
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 12, **request_values})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected.text
    unpenalized = offline.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=12))
    assert (expected.text == unpenalized[0].outputs[0].text) == (merged.repetition_penalty == 1.0)


def test_startup_log_names_the_defaults(server):
    assert "sampling defaults from the model's generation_config.json: temperature=0.0, repetition_penalty=1.8" \
        in server.log()
