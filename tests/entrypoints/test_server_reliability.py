"""What keeps one client from costing the server more than its request: work stops when
nobody waits for it, slow or oversized connections are cut off, heavy tokenizing stays off
the event loop, and a bad request never fails another one running beside it."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from server_process import launch_server
from tests.polling import wait_for

MODEL = "SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 4
LONG = {"model": MODEL, "prompt": "Write a long story:", "max_tokens": 900, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    proc = launch_server(tmp_path_factory.mktemp("limits"), "--kv-cache-memory", "64MiB",
                         "--max-model-len", "1024",
                         "--header-read-timeout", "1", "--body-read-timeout", "1",
                         "--max-body-size", "64KiB", "--request-timeout", str(REQUEST_TIMEOUT_S),
                         "--max-n", "4")
    yield proc
    proc.stop()


def metric(server, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def idle(server) -> bool:
    return (metric(server, "kvserve:num_requests_running") == 0
            and metric(server, "kvserve:num_requests_waiting") == 0
            and metric(server, "kvserve:kv_cache_usage_perc") == 0)


def assert_serves(server) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200, response.text


def sse_payloads(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# -- bounded requests ------------------------------------------------------------------------

def test_n_above_max_n_is_refused_at_once_and_below_it_runs(limited_server):
    url = f"{limited_server.base_url}/v1/completions"
    started = time.monotonic()
    huge = httpx.post(url, json={"prompt": "x", "n": 9223372036854775808}, timeout=30)
    over = httpx.post(url, json={"prompt": "x", "n": 5}, timeout=30)
    elapsed = time.monotonic() - started
    assert huge.status_code == over.status_code == 400
    assert huge.json()["error"]["param"] == over.json()["error"]["param"] == "n"
    assert "at most 4 (--max-n)" in over.json()["error"]["message"]
    assert elapsed < 2  # nothing was tokenized or scheduled (typically a few ms each)
    ok = httpx.post(url, json={"prompt": "x", "n": 4, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_context_the_kv_cache_cannot_hold_stops_the_server_at_start(tmp_path, tiny_model):
    # The model's 4096-token context does not fit 64 KiB of fp32 KV (one layer, one KV head
    # of 16: 128 bytes a token, 512 tokens): rather than refuse every request that leaves
    # max_tokens unset, the server does not start.
    with pytest.raises(RuntimeError) as info:
        launch_server(tmp_path, "--model", tiny_model, "--kv-cache-memory", "64KiB", "--max-model-len", "4096")
    assert "server exited with 1" in str(info.value)
    assert ("max_model_len (4096 tokens) does not fit the KV cache: one sequence of that length needs "
            "256 blocks of 16 tokens, and the cache holds 32 blocks (512 tokens). Raise "
            "--kv-cache-memory (or use --kv-cache-dtype fp8), or lower --max-model-len to at most "
            "512.") in str(info.value)


# -- work stops when nobody waits ------------------------------------------------------------

def test_non_streaming_client_that_gives_up_aborts_its_request(limited_server):
    assert wait_for(lambda: idle(limited_server))
    aborts = metric(limited_server, "kvserve:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{limited_server.base_url}/v1/completions", json=LONG, timeout=1.5)
    # Without the abort the request would run for its 900 tokens (past the 4 s limit too).
    assert wait_for(lambda: idle(limited_server), 2.0)
    assert metric(limited_server, "kvserve:request_success_total", finished_reason="abort") == aborts + 1
    assert_serves(limited_server)


def test_request_timeout_ends_a_request_with_an_error_and_frees_its_blocks(limited_server):
    assert wait_for(lambda: idle(limited_server))
    started = time.monotonic()
    response = httpx.post(f"{limited_server.base_url}/v1/completions", json=LONG, timeout=60)
    assert response.status_code == 504, response.text
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    assert response.json()["error"]["code"] == "request_timeout"
    assert "--request-timeout" in response.json()["error"]["message"]
    assert wait_for(lambda: idle(limited_server), 5)

    with httpx.stream("POST", f"{limited_server.base_url}/v1/completions", json=LONG | {"stream": True},
                      timeout=60) as streamed:
        payloads = sse_payloads(streamed)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "request_timeout"
    assert wait_for(lambda: idle(limited_server), 5)
    assert_serves(limited_server)


# -- connection hygiene ----------------------------------------------------------------------

def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def test_slow_or_silent_connections_are_closed(limited_server):
    silent, slow = _connect(limited_server), _connect(limited_server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
    started = time.monotonic()
    assert _read_all(silent) == b"" and _read_all(slow) == b""
    assert time.monotonic() - started < 5  # --header-read-timeout 1
    silent.close()
    slow.close()


def test_body_that_stops_arriving_gets_408(limited_server):
    with _connect(limited_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408")
    assert b"--body-read-timeout" in reply


def test_body_over_max_body_size_gets_413(limited_server):
    big = {"prompt": "x" * 70_000}
    response = httpx.post(f"{limited_server.base_url}/v1/completions", json=big, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 10_000

    chunked = httpx.post(f"{limited_server.base_url}/v1/completions", content=chunks(), timeout=30)
    assert chunked.status_code == 413
    assert_serves(limited_server)


def test_tokenizing_a_large_body_leaves_the_event_loop_free(server):
    prompt = "hello world, " * 300_000  # ~4 MB: a second or more of tokenizing
    result: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: result.append(httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": prompt}, timeout=120)))
    worker.start()
    time.sleep(0.3)  # the body is sent and tokenizing has begun
    health_times = []
    while worker.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        health_times.append(time.monotonic() - started)
        time.sleep(0.05)
    worker.join()
    assert result[0].status_code == 200 and result[0].json()["count"] > 500_000
    assert health_times and max(health_times) < 0.5, health_times


# -- compatibility and isolation -------------------------------------------------------------

def test_unknown_fields_are_ignored_with_a_warning_and_vllm_extensions_work(server):
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "min_tokens": 6, "top_k": 0, "repetition_penalty": 1.0,
            "stream": True, "max_completion_tokens": 6, "some_future_field": {"x": 1},
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *content, last = chunks
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 6  # usage so far, in every chunk
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in content)
    log = server.log()
    assert "ignored unknown fields max_completion_tokens, some_future_field" in log


def test_guidellm_chat_request_shape_streams_exactly_the_asked_tokens_with_usage(server):
    # The body guidellm 0.8 sends by default, verbatim: stop null, ignore_eos, usage in every chunk.
    body = {"model": MODEL, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 7, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    *content, last = [json.loads(p) for p in payloads[:-1]]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    assert all("usage" in c for c in content)
    assert [c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]] == ["length"]
    assert "Traceback" not in server.log()


def test_out_of_range_seed_never_fails_a_request_running_beside_it(server):
    events: list = []

    def stream() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions",
                          json={"prompt": "Tell me a story:", "max_tokens": 16, "stream": True,
                                "ignore_eos": True, "temperature": 0}, timeout=120) as response:
            for line in response.iter_lines():  # as they arrive: the bad requests come mid-stream
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))

    worker = threading.Thread(target=stream)
    worker.start()
    assert wait_for(lambda: len(events) >= 2, timeout=120)
    for seed, n in ((2**64 - 1, 2), (2**64, 1), (-(2**64), 1)):
        bad = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                         json={"prompt": "x", "seed": seed, "n": n, "max_tokens": 4})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
    worker.join(120)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
