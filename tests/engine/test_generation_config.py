"""The model's sampling defaults (generation_config.json): what they are read as, that a
request without sampling params runs with them, that `generation_config="none"` ignores them,
and that values SamplingParams refuses fail at load naming the file."""

from __future__ import annotations

import json
import os

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model_executor.loader import sampling_defaults

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
PROMPTS = [{"prompt_token_ids": [5, 9, 17, 3]}, {"prompt_token_ids": [30, 31, 4, 4, 8]}]


@pytest.mark.parametrize(("generation", "expected"), [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}, {"temperature": 0.6, "top_p": 0.9}),
    ({"temperature": 0.7, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05},
     {"temperature": 0.7, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}),
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1},
     {"temperature": 0.0, "repetition_penalty": 1.1}),  # transformers decodes greedily then
    ({"top_k": 0, "top_p": None}, {"top_k": -1}),  # transformers' "off" values
    ({"bos_token_id": 1, "eos_token_id": 2}, {}),
])
def test_sampling_defaults_read_from_generation_config(generation, expected) -> None:
    assert sampling_defaults(generation) == expected


def _model_dir(save_hf_model, generation: dict) -> str:
    directory = save_hf_model(LlamaForCausalLM(CONFIG))
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return directory


def _tokens(llm: LLM, params: SamplingParams | None = None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_requests_without_params_take_the_models_defaults(save_hf_model) -> None:
    model_dir = _model_dir(save_hf_model, {"do_sample": False, "repetition_penalty": 1.8, "max_new_tokens": 16})
    llm = LLM(model=model_dir, kv_cache_memory="16MiB")
    # max_tokens is not a sampling value: the default 16 of SamplingParams either way.
    assert llm.engine.default_sampling_params() == SamplingParams(temperature=0.0, repetition_penalty=1.8)
    penalized = _tokens(llm, SamplingParams(temperature=0.0, repetition_penalty=1.8))
    assert _tokens(llm) == penalized
    assert penalized != _tokens(llm, SamplingParams(temperature=0.0))  # the penalty changes these outputs
    ignoring = LLM(model=model_dir, kv_cache_memory="16MiB", generation_config="none")
    assert ignoring.engine.default_sampling_params() == SamplingParams()


def test_values_sampling_params_refuses_fail_at_load(save_hf_model) -> None:
    model_dir = _model_dir(save_hf_model, {"top_p": 0.0})
    with pytest.raises(ValueError, match=r"generation_config.json sampling values \{'top_p': 0.0\}.*--generation-config none"):
        LLM(model=model_dir, kv_cache_memory="16MiB")
    assert LLM(model=model_dir, kv_cache_memory="16MiB", generation_config="none").engine.sampling_defaults == {}
    with pytest.raises(ValueError, match="generation_config must be auto or none"):
        LLM(model=model_dir, kv_cache_memory="16MiB", generation_config="vllm")
