"""Who does not speculate: requests with n > 1 or prompt logprobs, and everyone while more
than disable_by_batch_size sequences run. They decode plainly, with the same output."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams

# Repetitive, so prompt lookup always finds something to draft.
PROMPT = {"prompt_token_ids": [5, 6, 7, 8] * 6}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture
def model_dir(save_hf_model) -> str:
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return save_hf_model(LlamaForCausalLM(config))


def _drafts(model_dir: str, prompts: list, params: list[SamplingParams], **spec) -> tuple[int, list]:
    llm = LLM(model_dir, kv_cache_memory="1MiB", block_size=4,
              speculative_config={**NGRAM, **spec})
    outputs = llm.generate(prompts, params)
    return llm.engine.spec_decode_stats.num_drafts, [[c.token_ids for c in o.outputs] for o in outputs]


def test_ineligible_requests_decode_plainly(model_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(model_dir, kv_cache_memory="1MiB", block_size=4).generate(PROMPT, greedy)
    expected = [c.token_ids for c in plain[0].outputs]
    for params in (SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)):
        num_drafts, outputs = _drafts(model_dir, [PROMPT], [params])
        assert num_drafts == 0
        assert all(tokens == expected[0] for tokens in outputs[0])
    num_drafts, outputs = _drafts(model_dir, [PROMPT], [greedy])
    assert num_drafts > 0 and outputs[0] == expected


def test_no_drafts_above_the_batch_size_limit(model_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    num_drafts, _ = _drafts(model_dir, [PROMPT] * 3, [greedy] * 3, disable_by_batch_size=2)
    assert num_drafts == 0
    num_drafts, _ = _drafts(model_dir, [PROMPT] * 2, [greedy] * 2, disable_by_batch_size=2)
    assert num_drafts > 0
