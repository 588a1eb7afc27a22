"""kvserve with a PEFT adapter against the PEFT model itself (and its merge_and_unload()):
the same log-probabilities within fp32 tolerance and the same greedy tokens."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.lora import LoRARequest
from kvserve.model_executor.loader import load_model
from tests.lora.peft_adapters import greedy_with_logprobs, make_adapter
from tests.lora.tiny_model import VOCAB, save_tiny_llama

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random tiny Llama saved as safetensors, and its transformers model."""
    directory = str(tmp_path_factory.mktemp("tiny") / "model")
    return save_tiny_llama(directory), directory


@pytest.fixture
def tiny_llama(tiny_llama_dir):
    """The transformers model and a fresh kvserve load (a LoRA engine wraps its linears)."""
    model, directory = tiny_llama_dir
    return model, load_model(directory, dtype=torch.float32)


def engine_outputs(llm: LLM, prompt: list[int], lora: LoRARequest | None):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params, lora_request=lora)[0].outputs[0]
    return output.token_ids, output.logprobs


def assert_matches(reference_ids, reference_logprobs, ids, logprobs) -> None:
    assert list(ids) == reference_ids
    for step, entries in enumerate(logprobs):
        for token_id, value in entries.items():
            assert value == pytest.approx(float(reference_logprobs[step, token_id]), abs=2e-4), (step, token_id)


@pytest.mark.parametrize("rank,use_rslora", [(4, False), (8, True), (16, False)])
def test_tiny_llama_matches_peft_and_merged(tiny_llama, tmp_path, rank, use_rslora) -> None:
    hf_model, loaded = tiny_llama
    peft_model = make_adapter(hf_model, str(tmp_path / "adapter"), rank, seed=rank, use_rslora=use_rslora)
    prompt = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(rank)).tolist()
    reference_ids, reference_logprobs = greedy_with_logprobs(peft_model, prompt, NEW_TOKENS)
    base_ids, _ = greedy_with_logprobs(hf_model, prompt, NEW_TOKENS)
    assert reference_ids != base_ids  # the adapter changes the output, so the test can fail

    llm = LLM(loaded=loaded, enable_lora=True, max_lora_rank=16, kv_cache_memory="16MiB", block_size=4,
              max_num_batched_tokens=8)  # the prompt prefills in two chunks
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    assert_matches(reference_ids, reference_logprobs, *engine_outputs(llm, prompt, lora))
    merged_ids, merged_logprobs = greedy_with_logprobs(peft_model.merge_and_unload(), prompt, NEW_TOKENS)
    assert_matches(merged_ids, merged_logprobs, *engine_outputs(llm, prompt, lora))
    # The base model, in the same engine, is unchanged.
    assert list(engine_outputs(llm, prompt, None)[0]) == base_ids


def test_bin_adapter_on_some_projections(tiny_llama, tmp_path) -> None:
    """A pytorch_model-style .bin adapter on q/v/down only: the other slices stay base-only."""
    hf_model, loaded = tiny_llama
    peft_model = make_adapter(hf_model, str(tmp_path / "adapter"), 8, seed=3, safe_serialization=False,
                              target_modules=["v_proj", "q_proj", "down_proj"])
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.bin")
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = greedy_with_logprobs(peft_model, prompt, NEW_TOKENS)
    llm = LLM(loaded=loaded, enable_lora=True, kv_cache_memory="16MiB", block_size=4)
    assert_matches(*reference, *engine_outputs(llm, prompt, LoRARequest("qvd", 7, str(tmp_path / "adapter"))))


def test_smollm2_matches_peft(smollm2_hf, smollm2_loaded, tmp_path) -> None:
    """The real model: a rank-8 rslora adapter on all seven projections."""
    peft_model = make_adapter(smollm2_hf, str(tmp_path / "adapter"), 8, seed=1, use_rslora=True)
    prompt = [1, 504, 3458, 282, 4649, 314, 260, 1345, 28, 378, 12, 9987, 45, 2081]
    reference_ids, reference_logprobs = greedy_with_logprobs(peft_model, prompt, NEW_TOKENS)
    with torch.no_grad():
        base_logprobs = torch.log_softmax(smollm2_hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert (base_logprobs - reference_logprobs[0]).abs().max() > 0.5  # the adapter matters
    # A copy of the fp32 weights other tests share: the LoRA engine wraps its linears.
    loaded = dataclasses.replace(smollm2_loaded, model=copy.deepcopy(smollm2_loaded.model))
    llm = LLM(loaded=loaded, enable_lora=True, max_lora_rank=8, kv_cache_memory="64MiB", max_model_len=256)
    ids, logprobs = engine_outputs(llm, prompt, LoRARequest("smol", 1, str(tmp_path / "adapter")))
    assert list(ids) == reference_ids
    for step, entries in enumerate(logprobs):
        for token_id, value in entries.items():
            assert value == pytest.approx(float(reference_logprobs[step, token_id]), abs=2e-3)
