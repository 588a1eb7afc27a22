"""Through the whole engine: sampled output with a poor draft model is distributed exactly
as the target model says. A tiny random target with a 6-token vocabulary and a tiny
random draft (different weights) generate; the joint distribution of the first 3 tokens
(tokens 2 and 3 come out of verification) is compared by chi-square with the exact one
computed from transformers' forward pass of the target, filtered by top-k / top-p by
definition. A verifier with biased acceptance must fail the same test."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.spec_decode import rejection_sampler
from tests.conftest import randomize, save_tokenizer
from tests.spec_decode.distribution import (
    P_VALUE_THRESHOLD, all_sequences, chi_square_p_value, reference_filter,
)

VOCAB = 6
PROMPT = [1, 4, 0, 3]


def _tiny(seed: int, directory: str) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=False, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    randomize(model, seed)
    with torch.no_grad():  # sharper next-token distributions than 0.1-scale weights give
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(directory)
    save_tokenizer(directory, VOCAB)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target_dir, draft_dir = os.path.join(root, "target"), os.path.join(root, "draft")
    return _tiny(0, target_dir), target_dir, draft_dir, _tiny(1, draft_dir)


def _exact(model: LlamaForCausalLM, top_k: int, top_p: float) -> dict[tuple[int, ...], float]:
    prefixes = all_sequences(VOCAB, 2)
    with torch.no_grad():
        input_ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        logits = model(input_ids).logits[:, len(PROMPT) - 1 :].float()
    # Row (t1, t2) holds p(. | prompt), p(. | prompt t1) and p(. | prompt t1 t2).
    probs = [reference_filter(torch.softmax(logits[:, i], dim=-1), top_k, top_p) for i in range(3)]
    return {
        (t1, t2, t3): float(probs[0][row, t1] * probs[1][row, t2] * probs[2][row, t3])
        for row, (t1, t2) in enumerate(prefixes)
        for t3 in range(VOCAB)
    }


def _samples(target_dir: str, draft_dir: str, params: SamplingParams, num: int) -> list[tuple[int, ...]]:
    llm = LLM(target_dir, max_num_seqs=num, max_num_batched_tokens=num * (len(PROMPT) + 3),
              kv_cache_memory="16MiB", block_size=4, enable_prefix_caching=False,
              speculative_config={"method": "draft_model", "model": draft_dir,
                                  "num_speculative_tokens": 2, "disable_by_batch_size": num})
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * num, params)
    stats = llm.engine.spec_decode_stats
    assert stats.num_drafts >= num and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    return [tuple(o.outputs[0].token_ids[:3]) for o in outputs]


def test_engine_samples_match_the_target_quick(models):
    """The default suite's check (the exact 30,000-sample test of the rejection sampler is
    in test_rejection_sampler.py); the 20,000-sample engine runs below are marked slow."""
    target, target_dir, draft_dir, _ = models
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.85, max_tokens=4, ignore_eos=True)
    samples = _samples(target_dir, draft_dir, params, 2_000)
    assert chi_square_p_value(samples, _exact(target, 4, 0.85)) > P_VALUE_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (4, 0.85)], ids=["temperature-1", "top-k-top-p"])
def test_engine_samples_match_the_target(models, top_k, top_p):
    target, target_dir, draft_dir, _ = models
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=4, ignore_eos=True)
    samples = _samples(target_dir, draft_dir, params, 20_000)
    assert chi_square_p_value(samples, _exact(target, top_k, top_p)) > P_VALUE_THRESHOLD


@pytest.mark.slow
def test_biased_verifier_is_caught(models, monkeypatch):
    target, target_dir, draft_dir, _ = models
    monkeypatch.setattr(rejection_sampler, "accept_mask", lambda p, q, u: u * q < 1.5 * p)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    samples = _samples(target_dir, draft_dir, params, 20_000)
    assert chi_square_p_value(samples, _exact(target, -1, 1.0)) < P_VALUE_THRESHOLD


def test_seeded_requests_reproduce_whatever_the_batch(models):
    _, target_dir, draft_dir, _ = models
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def run(num_others: int) -> list[int]:
        llm = LLM(target_dir, kv_cache_memory="4MiB", block_size=4,
                  speculative_config={"method": "draft_model", "model": draft_dir,
                                      "num_speculative_tokens": 3})
        prompts = [{"prompt_token_ids": PROMPT}] * (1 + num_others)
        outputs = llm.generate(prompts, [seeded] + [other] * num_others)
        assert llm.engine.spec_decode_stats.num_drafts > 0
        return outputs[0].outputs[0].token_ids

    assert run(0) == run(3)


def test_abort_and_finish_free_both_caches(models):
    _, target_dir, draft_dir, _ = models
    llm = LLM(target_dir, kv_cache_memory="1MiB", block_size=4,
              speculative_config={"method": "draft_model", "model": draft_dir,
                                  "num_speculative_tokens": 3})
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    engine.add_request("keep", {"prompt_token_ids": PROMPT}, params)
    engine.add_request("drop", {"prompt_token_ids": PROMPT * 3}, params)
    for _ in range(3):
        engine.step()
    draft_cache = engine.core.runner.speculator.proposer.kv_cache
    assert engine.spec_decode_stats.num_drafts > 0 and "drop#0" in draft_cache.block_tables
    engine.abort_request("drop")
    assert "drop#0" not in engine.core.kv_cache.block_tables
    engine.step()  # the runner, which holds the draft model, learns of it with the next step
    assert "drop#0" not in draft_cache.block_tables
    while engine.has_unfinished_requests():
        engine.step()
    for cache in (engine.core.kv_cache, draft_cache):
        assert cache.num_free_blocks == engine.core.runner.num_blocks
