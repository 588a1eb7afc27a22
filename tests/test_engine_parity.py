"""Greedy output of the whole engine equals transformers' greedy generate on the real model.

Five prompts of different lengths that share a prefix run as one batch, 64 new tokens
each, in fp32 on CPU; then again with a small prefill chunk, with prefix-cache hits and
with a KV pool small enough to force preemption. Each must match token for token.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.model_runner import kv_cache_bytes_per_block

SHARED_PREFIX = (
    "You are a careful assistant. Answer in full sentences, and explain the reasoning "
    "behind every step so that a student can follow it. "
)
QUESTIONS = [
    "Hi!",
    "Name three rivers in Europe and say which countries they flow through.",
    "Write a haiku about autumn leaves.",
    "Explain why the sky is blue, in terms of how light scatters off the molecules of the "
    "atmosphere, and why sunsets look red instead.",
    "def fibonacci(n):",
]
NUM_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def loaded(smollm2_loaded):
    return smollm2_loaded


@pytest.fixture(scope="module")
def prompt_ids(loaded) -> list[list[int]]:
    return [loaded.tokenizer(SHARED_PREFIX + q).input_ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_hf, prompt_ids) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids])
            out = smollm2_hf.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS, pad_token_id=smollm2_hf.config.eos_token_id,
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def _greedy(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    return [o.outputs[0].token_ids for o in outputs]


def test_prompts_differ_in_length(prompt_ids):
    assert len({len(ids) for ids in prompt_ids}) == len(prompt_ids)


def test_batched_greedy_matches_transformers(loaded, prompt_ids, hf_greedy):
    llm = LLM(loaded=loaded, enable_prefix_caching=False, kv_cache_memory="256MiB", max_model_len=4096)
    assert _greedy(llm, prompt_ids) == hf_greedy


def test_small_prefill_chunks_match_transformers(loaded, prompt_ids, hf_greedy):
    # A 13-token budget splits every prompt across several steps, off block boundaries.
    llm = LLM(
        loaded=loaded, enable_prefix_caching=False, max_num_batched_tokens=13,
        kv_cache_memory="256MiB", max_model_len=4096,
    )
    assert _greedy(llm, prompt_ids) == hf_greedy


def test_prefix_cache_hits_match_transformers(loaded, prompt_ids, hf_greedy):
    llm = LLM(loaded=loaded, enable_prefix_caching=True, kv_cache_memory="256MiB", max_model_len=4096)
    assert _greedy(llm, prompt_ids) == hf_greedy
    stats = llm.engine.core.scheduler.prefix_cache_stats
    hits_first_run = stats.hit_tokens
    # Second run: every prompt's full blocks are cached now.
    assert _greedy(llm, prompt_ids) == hf_greedy
    block_size = llm.engine.core.cache_config.block_size
    expected_second = sum((len(ids) - 1) // block_size * block_size for ids in prompt_ids)
    assert stats.hit_tokens - hits_first_run == expected_second


def test_preemption_matches_transformers(loaded, prompt_ids, hf_greedy):
    block_size = 16
    largest = max(len(ids) for ids in prompt_ids) + NUM_NEW_TOKENS
    num_blocks = -(-largest // block_size) + 2  # one request fits, five at once do not
    llm = LLM(
        loaded=loaded, enable_prefix_caching=False, block_size=block_size,
        kv_cache_memory=str(num_blocks * kv_cache_bytes_per_block(loaded.config, block_size)),
        max_model_len=num_blocks * block_size,
    )
    assert llm.engine.core.runner.num_blocks == num_blocks
    assert _greedy(llm, prompt_ids) == hf_greedy
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv_cache.num_free_blocks == num_blocks
