"""Greedy output with speculation is token for token the plain greedy output on the real
SmolLM2, for every drafting method, batched with requests that do not speculate, with
prefix-cache hits, small prefill chunks (which also cut drafts to the token budget) and
forced preemption."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model_executor.model_runner import kv_cache_bytes_per_block

PARAGRAPH = (
    "The river rises in the northern hills, runs south through three small towns, and "
    "reaches the sea after two hundred kilometres."
)
PROMPTS = [
    f"Repeat the following sentence twice.\n{PARAGRAPH}\nAnswer: {PARAGRAPH} ",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Write a haiku about autumn leaves.",
    f"Repeat the following sentence twice.\n{PARAGRAPH}\nAnswer:",
]
NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# Run alongside the greedy requests: speculation never applies to them (n > 1), or they
# sample; their outputs are not compared.
OTHERS = [
    SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=12),
    SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=20),
]

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "int4-self": {"method": "draft_model", "model": "same", "quantization": "int4",
                  "num_speculative_tokens": 3},
    "tiny-draft": {"method": "draft_model", "num_speculative_tokens": 3},
}


# Draft-model runs cost k draft passes per step: with small chunks or preemption they take
# well over 20 s on a 2-core CPU, so those are in the slow suite.
DRAFT_MODEL_SLOW = [
    "ngram",
    pytest.param("int4-self", marks=pytest.mark.slow),
    pytest.param("tiny-draft", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_loaded) -> list[list[int]]:
    return [smollm2_loaded.tokenizer(p).input_ids for p in PROMPTS]


def _run(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = [GREEDY] * len(prompts) + OTHERS
    outputs = llm.generate(prompts + prompts[: len(OTHERS)], params)
    return [list(o.outputs[0].token_ids) for o in outputs[: len(prompts)]]


@pytest.fixture(scope="module")
def plain(smollm2_loaded, prompt_ids) -> list[list[int]]:
    return _run(LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=1024), prompt_ids)


def _config(method: str, tiny_draft: str) -> dict:
    config = dict(METHODS[method])
    if method == "tiny-draft":
        config["model"] = tiny_draft
    return config


def _check(llm: LLM, prompt_ids, plain) -> None:
    assert _run(llm, prompt_ids) == plain
    stats = llm.engine.spec_decode_stats
    assert stats.num_drafts > 0
    # The pool is whole again: nothing leaked by rejected drafts.
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.runner.num_blocks


# The tiny random draft runs slow (the int4 self-draft covers draft_model in CI's 10 minutes).
@pytest.mark.parametrize("method", ["ngram", "int4-self", pytest.param("tiny-draft", marks=pytest.mark.slow)])
def test_batched_with_prefix_hits(method, smollm2_loaded, tiny_smollm2_draft, prompt_ids, plain):
    # A self-draft's cache takes as many blocks again: 64 MiB holds 720 tokens then.
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=512,
              speculative_config=_config(method, tiny_smollm2_draft))
    _check(llm, prompt_ids, plain)
    if method == "ngram":
        assert llm.engine.spec_decode_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", DRAFT_MODEL_SLOW)
def test_small_prefill_chunks(method, smollm2_loaded, tiny_smollm2_draft, prompt_ids, plain):
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=19,
              enable_prefix_caching=False, speculative_config=_config(method, tiny_smollm2_draft))
    _check(llm, prompt_ids, plain)


@pytest.mark.parametrize("method", DRAFT_MODEL_SLOW)
def test_forced_preemption(method, smollm2_loaded, tiny_smollm2_draft, prompt_ids, plain):
    block_size = 8
    largest = max(len(ids) for ids in prompt_ids) + NUM_NEW_TOKENS
    num_blocks = -(-largest // block_size) + 3  # one request fits, all at once do not
    bytes_per_block = kv_cache_bytes_per_block(smollm2_loaded.config, block_size)
    config = _config(method, tiny_smollm2_draft)
    if method == "int4-self":
        bytes_per_block *= 2  # the draft's cache takes as many blocks again
    elif method == "tiny-draft":
        bytes_per_block += 2 * 2 * block_size * 1 * 16 * 4  # 2 layers, 1 KV head of 16, fp32
    llm = LLM(loaded=smollm2_loaded, block_size=block_size, enable_prefix_caching=False,
              kv_cache_memory=str(num_blocks * bytes_per_block), max_model_len=num_blocks * block_size,
              speculative_config=config)
    assert llm.engine.core.runner.num_blocks == num_blocks
    _check(llm, prompt_ids, plain)
    assert llm.engine.core.scheduler.num_preemptions > 0
