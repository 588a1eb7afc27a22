"""The OpenAI-compatible server end to end: the official client and raw HTTP against a real
server process, checked against the offline engine, the tokenizer and OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import SamplingParams
from tests.polling import wait_for

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."}]


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def assert_serves(server) -> None:
    """After any error, the next ordinary request still succeeds."""
    result = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert result.choices[0].finish_reason in ("stop", "length")


def stream_completion(client, **kwargs) -> tuple[str, list]:
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# -- completions ---------------------------------------------------------------------------

def test_completion_matches_offline_engine_and_openai_shape(server, reference_llm):
    # httpx's default 5 s is less than a loaded 2-core machine may take for 12 tokens.
    raw = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}, timeout=60).json()
    reference = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
    expected_completion = len(reference.outputs[0].token_ids)
    assert raw["id"].startswith("cmpl-") and raw["object"] == "text_completion"
    assert raw["model"] == MODEL and abs(raw["created"] - time.time()) < 60
    assert raw["choices"] == [{"index": 0, "text": reference.outputs[0].text, "logprobs": None,
                               "finish_reason": reference.outputs[0].finish_reason}]
    num_prompt = len(reference_llm.get_tokenizer()(PROMPT).input_ids)
    assert raw["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": expected_completion,
                            "total_tokens": num_prompt + expected_completion}


def test_streamed_completion_equals_non_streamed_with_usage_chunk(server):
    client = server.client()
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**args)
    text, chunks = stream_completion(client, stream_options={"include_usage": True}, **args)
    assert text == whole.choices[0].text
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    *content, last = chunks
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage == whole.usage
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_finish_reason_length_and_usage_equals_tokenizer_counts(server):
    client = server.client()
    result = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=7,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 7
    counted = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Count: 1, 2, 3,"}).json()
    assert result.usage.prompt_tokens == counted["count"]


def test_prompt_forms_echo_and_prompt_lists(server, reference_llm):
    client = server.client()
    tokenizer = reference_llm.get_tokenizer()
    ids = tokenizer(PROMPT).input_ids
    args = dict(model=MODEL, max_tokens=6, temperature=0)
    single = client.completions.create(prompt=PROMPT, **args).choices[0].text
    assert client.completions.create(prompt=ids, **args).choices[0].text == single
    batch = client.completions.create(prompt=[PROMPT, "2 + 2 ="], **args)
    other = client.completions.create(prompt="2 + 2 =", **args).choices[0].text
    assert [(c.index, c.text) for c in batch.choices] == [(0, single), (1, other)]
    id_batch = client.completions.create(prompt=[ids, tokenizer("2 + 2 =").input_ids], **args)
    assert [c.text for c in id_batch.choices] == [single, other]
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer("2 + 2 =").input_ids)
    echoed = client.completions.create(prompt=PROMPT, echo=True, **args).choices[0].text
    assert echoed == PROMPT + single


def test_n3_choices_streamed_by_index_equal_non_streamed_and_offline(server, reference_llm):
    client = server.client()
    args = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                seed=1234, n=3)
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {c.index: c.text for c in whole.choices}
    reference = reference_llm.generate(args["prompt"], SamplingParams(
        n=3, temperature=1.0, seed=1234, max_tokens=8))[0]
    assert [c.text for c in whole.choices] == [c.text for c in reference.outputs]
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in reference.outputs)


def test_stop_string_cuts_text_before_it(server, reference_llm):
    client = server.client()
    args = dict(model=MODEL, prompt="List of fruits: apple, banana,", max_tokens=16, temperature=0)
    free = reference_llm.generate(args["prompt"], SamplingParams(temperature=0, max_tokens=16))[0]
    words = free.outputs[0].text.split()
    stop = words[len(words) // 2]
    expected = free.outputs[0].text[:free.outputs[0].text.index(stop)]
    result = client.completions.create(stop=[stop], **args).choices[0]
    assert (result.text, result.finish_reason) == (expected, "stop")
    streamed, chunks = stream_completion(client, stop=stop, **args)
    assert streamed == expected and stop not in streamed
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_match_offline_engine(server, reference_llm):
    result = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3).choices[0]
    reference = reference_llm.generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    logprobs = result.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    expected = [entry[t] for t, entry in zip(reference.token_ids, reference.logprobs)]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert "".join(logprobs.tokens) == result.text
    # Greedy: the chosen token is the best of the top alternatives.
    assert all(max(top.values()) == pytest.approx(lp) for top, lp in
               zip(logprobs.top_logprobs, logprobs.token_logprobs))
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets


# -- chat ----------------------------------------------------------------------------------

def test_chat_matches_offline_chat_and_streams_the_same(server, reference_llm):
    client = server.client()
    reference = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                           max_completion_tokens=12)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    choice = whole.choices[0]
    assert (choice.index, choice.message.role) == (0, "assistant")
    assert choice.message.content == reference.outputs[0].text
    assert choice.finish_reason == reference.outputs[0].finish_reason
    assert whole.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert whole.usage.completion_tokens == len(reference.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_logprobs_and_top_logprobs_counts(server):
    result = server.client().chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 5
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)
    assert "".join(entry.token for entry in content) == result.choices[0].message.content


def test_chat_n3_streams_each_choice_index(server):
    client = server.client()
    args = dict(model=MODEL, messages=CHAT, temperature=0.9, seed=7, n=3, max_tokens=6)
    whole = client.chat.completions.create(**args)
    streamed = {0: "", 1: "", 2: ""}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}


# -- other endpoints -----------------------------------------------------------------------

def test_models_tokenize_detokenize(server, reference_llm):
    models = server.client().models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "kvserve")]
    tokenizer = reference_llm.get_tokenizer()
    text = "Hello, wörld!"
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()
    assert tokens == {"tokens": tokenizer(text).input_ids, "count": len(tokenizer(text).input_ids),
                      "max_model_len": 1024}
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == reference_llm.apply_chat_template(CHAT)
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}


# -- concurrency ---------------------------------------------------------------------------

def test_8_concurrent_streams_each_equal_its_sequential_result(server):
    # 5 tokens each: every stream still decodes in batches of up to 8 (at 250 ms a token on
    # one thread, the 8 sequential references cost most of this test).
    prompts = [f"Fact number {i} about the ocean:" for i in range(8)]
    client = server.client()
    sequential = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
                  .choices[0].text for p in prompts]

    async def main() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                          max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await async_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == sequential


# -- errors --------------------------------------------------------------------------------

def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.base_url}{path}", content=content,
                      headers={"content-type": "application/json"})


BAD_REQUESTS = [
    ("/v1/completions", '{"prompt": "x",', 400, None, "Malformed JSON"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 5}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of", "best_of"),
    ("/v1/completions", {"prompt": ""}, 400, None, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, None, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, None, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/v1/completions", {}, 400, "prompt", "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, None, "content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", [1, 2], 400, None, "dictionary"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "vocabulary"),
    ("/v1/nothing", {}, 404, None, "Not Found"),
    # Numbers outside what they can mean, and Infinity / NaN, which Python's JSON parser takes.
    ("/v1/completions", {"prompt": "x", "n": 2**63}, 400, "n", "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n", "--max-n"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**64)}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64 - 1, "n": 2}, 400, "seed", "seed + n - 1"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**63}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "priority": 2**63}, 400, "priority", "priority"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": None, "min_tokens": 5000}, 400, "min_tokens",
     "min_tokens (5000)"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2**64}, 400,
     "max_completion_tokens", "max_completion_tokens"),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}', 400, "temperature", "finite"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e308}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e308}, 400, "repetition_penalty",
     "repetition_penalty"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": Infinity}}', 400, "logit_bias.5", "finite"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": NaN}}', 400, "logit_bias.5", "finite"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    # Tool and output-format fields are checked, and the deprecated functions refused: ignoring
    # them would hand back something other than what was asked for.
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400,
     "tools.0.function", "Field required"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions",
     "use tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice",
     "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format.type", "json_schema"),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, 400, None, "parsing the body"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "parsing the body"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, None, "empty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, None, "logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "in_message"), BAD_REQUESTS)
def test_bad_request_gets_openai_error(server, path, body, status, param, in_message):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert in_message in error["message"]
    if param is not None:
        assert error["param"] == param


def test_requests_succeed_between_and_after_bad_ones(server):
    """No bad request wedges the server or what it serves next (one generation a few bad
    requests, not one each: a generation is most of a second on a 2-core CI machine)."""
    for index, (path, body, status, _, _) in enumerate(BAD_REQUESTS):
        assert _post(server, path, body).status_code == status
        if index % 8 == 7:
            assert_serves(server)
    assert_serves(server)


def test_prompt_too_long_uses_the_context_length_wording(server, reference_llm):
    prompt = "hello " * 1000
    num_prompt = len(reference_llm.get_tokenizer()(prompt).input_ids)
    response = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 100})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"This model's maximum context length is 1024 tokens. However, you requested "
                   f"100 output tokens and your prompt contains {num_prompt} input tokens, for a "
                   f"total of {num_prompt + 100} tokens. Please reduce the length of the input "
                   "prompt or the number of requested output tokens.",
        "type": "invalid_request_error", "param": "input_tokens", "code": "context_length_exceeded",
    }
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=100)
    assert_serves(server)


# -- lifecycle and metrics -----------------------------------------------------------------

def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    assert wait_for(lambda: metric(server, "kvserve:num_requests_running") == 0)
    idle_usage = metric(server, "kvserve:kv_cache_usage_perc")
    aborts_before = metric(server, "kvserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Write a long story:", "max_tokens": 900, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server, "kvserve:num_requests_running") == 1
        assert metric(server, "kvserve:kv_cache_usage_perc") > idle_usage
        # The report and the gauges read the engine's state (the stream goes on between the
        # two reads: a block more at most): blocks the stream holds, its last one partly
        # filled (the slots past its tokens, fewer than a block).
        report = httpx.get(f"{server.base_url}/debug/kv").json()
        blocks = report["blocks"]
        used = blocks["used"]
        assert used > 0 and blocks["used"] + blocks["cached"] + blocks["free"] == blocks["total"]
        assert 0 <= metric(server, "kvserve:kv_cache_blocks", state="used") - used <= 1
        assert 0 <= report["fragmentation"]["unused_slots"] < report["block_size"]
        assert report["fragmentation"]["internal"] == pytest.approx(
            report["fragmentation"]["unused_slots"] / (used * report["block_size"]))
        assert 0 <= metric(server, "kvserve:kv_cache_internal_fragmentation") < 1
    # Closing the connection mid-stream must abort the request and free its blocks.
    assert wait_for(lambda: metric(server, "kvserve:kv_cache_usage_perc") == idle_usage, 10)
    assert metric(server, "kvserve:num_requests_running") == 0
    assert httpx.get(f"{server.base_url}/debug/kv").json()["fragmentation"]["unused_slots"] == 0
    assert metric(server, "kvserve:request_success_total", finished_reason="abort") == aborts_before + 1
    assert_serves(server)


def test_metrics_count_exactly_what_a_request_used(server):
    names = ["kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
             "kvserve:time_to_first_token_seconds_count", "kvserve:e2e_request_latency_seconds_count",
             "kvserve:time_per_output_token_seconds_count", "kvserve:request_queue_time_seconds_count",
             "kvserve:inter_token_latency_seconds_count", "kvserve:prefix_cache_queries_total"]
    before = {name: metric(server, name) for name in names}
    length_before = metric(server, "kvserve:request_success_total", finished_reason="length")
    result = server.client().completions.create(model=MODEL, prompt="Metrics test prompt",
                                                max_tokens=5, extra_body={"ignore_eos": True})
    after = {name: metric(server, name) for name in names}
    delta = {name: after[name] - before[name] for name in names}
    assert delta["kvserve:prompt_tokens_total"] == result.usage.prompt_tokens
    assert delta["kvserve:generation_tokens_total"] == 5
    for name in names[2:6]:
        assert delta[name] == 1, name
    assert delta["kvserve:inter_token_latency_seconds_count"] == 4
    assert delta["kvserve:prefix_cache_queries_total"] == result.usage.prompt_tokens
    assert metric(server, "kvserve:request_success_total", finished_reason="length") == length_before + 1
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("kvserve:num_requests_waiting", "kvserve:num_sequences_running",
                 "kvserve:num_sequences_waiting", "kvserve:num_preemptions_total",
                 "kvserve:prefix_cache_hits_total", "kvserve:kv_cache_usage_perc"):
        assert name in text


def test_startup_log_names_model_dtype_device_and_kv_capacity(server):
    log = server.log()
    line = next(line for line in log.splitlines() if "max concurrent tokens" in line)
    for word in (MODEL, "dtype=float32", "device=cpu", "KV blocks"):
        assert word in line
    assert server.saw_503_while_loading
