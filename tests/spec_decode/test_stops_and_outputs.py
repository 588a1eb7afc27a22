"""Stops and limits landing inside an accepted run end the output exactly where plain
decoding ends it; logprobs and multi-token streaming steps match plain decoding.

Drafts come from the plain run's own continuation (perfect drafts, k = 4), so every step
after the prefill accepts a whole run of 5 tokens: outputs 1-5, 6-10, 11-15, ..."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.spec_decode.proposers import ScriptedProposer

PROMPT = "The history of the Roman Empire began"
LENGTH = 30


@pytest.fixture(scope="module")
def prompt_ids(smollm2_loaded) -> list[int]:
    return smollm2_loaded.tokenizer(PROMPT).input_ids


@pytest.fixture(scope="module")
def plain_llm(smollm2_loaded) -> LLM:
    return LLM(loaded=smollm2_loaded, kv_cache_memory="16MiB", max_model_len=256)


@pytest.fixture(scope="module")
def continuation(plain_llm, prompt_ids) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True)
    return list(plain_llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0].token_ids)


@pytest.fixture
def spec_llm(smollm2_loaded, prompt_ids, continuation) -> LLM:
    llm = LLM(loaded=smollm2_loaded, kv_cache_memory="16MiB", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.core.runner.speculator.proposer = ScriptedProposer(
        {tuple(prompt_ids): continuation}, smollm2_loaded.config.vocab_size)
    return llm


def _same(plain_llm, spec_llm, prompt_ids, params):
    prompt = {"prompt_token_ids": prompt_ids}
    expected = plain_llm.generate(prompt, params)[0].outputs[0]
    got = spec_llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert (got.finish_reason, got.stop_reason) == (expected.finish_reason, expected.stop_reason)
    assert spec_llm.engine.spec_decode_stats.num_accepted_tokens > 0
    return expected


def _inside_a_run(index: int) -> bool:
    return index > 5 and index % 5 not in (0, 4)  # neither first nor last of a run


def test_stop_token_inside_a_run(plain_llm, spec_llm, prompt_ids, continuation):
    index = next(i for i, t in enumerate(continuation)
                 if _inside_a_run(i) and t not in continuation[:i])
    params = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True,
                            stop_token_ids=[continuation[index]])
    out = _same(plain_llm, spec_llm, prompt_ids, params)
    assert len(out.token_ids) == index + 1 and out.stop_reason == continuation[index]


def test_stop_string_inside_a_run(plain_llm, spec_llm, prompt_ids, continuation, smollm2_loaded):
    tokenizer = smollm2_loaded.tokenizer
    index = next(i for i, t in enumerate(continuation)
                 if _inside_a_run(i) and len(tokenizer.decode([t]).strip()) >= 3)
    stop = tokenizer.decode([continuation[index]]).strip()
    params = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True, stop=[stop])
    out = _same(plain_llm, spec_llm, prompt_ids, params)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < LENGTH


def test_max_tokens_inside_a_run(plain_llm, spec_llm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    out = _same(plain_llm, spec_llm, prompt_ids, params)
    assert len(out.token_ids) == 13 and out.finish_reason == "length"


def test_logprobs_match_plain(plain_llm, spec_llm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = {"prompt_token_ids": prompt_ids}
    expected = plain_llm.generate(prompt, params)[0].outputs[0]
    got = spec_llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        for token, value in theirs.items():
            assert mine[token] == pytest.approx(value, abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)


def test_one_step_streams_several_tokens(plain_llm, spec_llm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True)
    engine = spec_llm.engine
    engine.add_request("s", {"prompt_token_ids": prompt_ids}, params)
    sizes, text, output = [], "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            sizes.append(len(output.outputs[0].token_ids))
            assert output.outputs[0].text.startswith(text)  # text only ever grows
            text = output.outputs[0].text
    assert sizes == [1, 6, 11, 16, 21, 26, 30]
    expected = plain_llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
    assert (output.outputs[0].token_ids, text) == (expected.token_ids, expected.text)
    assert output.metrics.spec_decode.mean_accepted_length == pytest.approx(29 / 6)


def test_prometheus_counters(spec_llm, prompt_ids):
    from kvserve.metrics import ServerMetrics

    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    spec_llm.generate({"prompt_token_ids": prompt_ids}, params)
    metrics = ServerMetrics("m")
    metrics.attach_engine(spec_llm.engine)
    text = metrics.exposition().decode()
    # Outputs 1 (prefill), then two runs of 4 accepted drafts + 1: 6 and 11.
    for line in [
        'kvserve:spec_decode_num_drafts_total{model_name="m"} 2.0',
        'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 8.0',
        'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 8.0',
        'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
        'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 2.0',
    ]:
        assert line in text
