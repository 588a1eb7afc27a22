"""A server of its own (it gets SIGTERM): API keys, the waiting-queue limit, draining. None of
this depends on the model, so the server runs the tiny one; its steps take milliseconds, so
the requests that must outlast others ask for hundreds of tokens."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from dashboard_events import EventReader
from server_process import launch_server
from tests.polling import wait_for

MODEL = "tiny"
KEY = "test-secret"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, tiny_model):
    # One running sequence and one waiting slot make the queue limit reachable on demand;
    # the key comes from the environment to cover KVSERVE_API_KEY.
    proc = launch_server(tmp_path_factory.mktemp("lifecycle"), "--model", tiny_model, "--served-model-name", MODEL,
                         "--max-model-len", "1024", "--max-num-seqs", "1",
                         "--max-waiting-requests", "1", "--shutdown-timeout", "60",
                         "--stream-interval", "4", env={"KVSERVE_API_KEY": KEY})
    yield proc
    proc.stop()


def _waiting(server) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("kvserve:num_requests_waiting{"):
            return float(line.split()[-1])
    raise AssertionError("no waiting gauge")


def _stream_in_thread(server, max_tokens: int, events: list) -> threading.Thread:
    """A streaming completion read on a thread; `events` gets each SSE payload."""

    def run() -> None:
        body = {"prompt": "Tell me a story:", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as response:
            events.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_health_is_503_while_loading(small_server):
    assert small_server.saw_503_while_loading
    assert httpx.get(f"{small_server.base_url}/health").status_code == 200


def test_api_key_required_when_configured(small_server):
    with pytest.raises(openai.AuthenticationError) as info:
        small_server.client(api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401
    missing = httpx.post(f"{small_server.base_url}/v1/completions", json={"prompt": "Hi"})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{small_server.base_url}/health").status_code == 200  # no key needed
    for path in ("/docs", "/redoc", "/openapi.json", "/debug/kv"):  # behind the key too
        assert httpx.get(f"{small_server.base_url}{path}").status_code == 401, path
        keyed = httpx.get(f"{small_server.base_url}{path}", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200, path
    assert "/v1/completions" in httpx.get(f"{small_server.base_url}/openapi.json",
                                          headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    result = small_server.client(api_key=KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert result.usage.completion_tokens >= 1


def test_dashboard_needs_the_key_as_a_header_or_its_cookie(small_server):
    base = small_server.base_url
    for path in ("/dashboard", "/dashboard/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "kvserve_api_key=wrong"}):
            assert httpx.get(f"{base}{path}", headers=headers).status_code == 401, (path, headers)
    # A browser without the key gets the form that sets the cookie, not the page.
    refused = httpx.get(f"{base}/dashboard")
    assert "kvserve_api_key" in refused.text and "block-map" not in refused.text
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"Cookie": f"kvserve_api_key={KEY}"}):
        page = httpx.get(f"{base}/dashboard", headers=headers)
        assert page.status_code == 200 and "block-map" in page.text
        events = EventReader(base, headers)
        try:
            event = events.wait_for(lambda e: e["status"] == "ok", timeout=30)
            assert event["kv"]["blocks"]["total"] > 0
        finally:
            events.close()
        assert events.status_code == 200


def test_full_waiting_queue_answers_429_then_recovers(small_server):
    running, waiting = [], []
    first = _stream_in_thread(small_server, 600, running)
    assert wait_for(lambda: len(running) > 2)  # streaming: it holds the only running slot
    second = _stream_in_thread(small_server, 4, waiting)
    assert wait_for(lambda: _waiting(small_server) == 1)
    with pytest.raises(openai.RateLimitError) as info:
        small_server.client(api_key=KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "1"
    first.join(120)
    second.join(120)
    assert running[-1] == waiting[-1] == "[DONE]"
    result = small_server.client(api_key=KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert result.choices[0].finish_reason in ("stop", "length")


def test_stream_interval_buffers_tokens_without_changing_the_text(small_server):
    body = {"model": MODEL, "prompt": "List some fruits:", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    whole = httpx.post(f"{small_server.base_url}/v1/completions", json=body, headers=headers,
                       timeout=120).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{small_server.base_url}/v1/completions", headers=headers,
                      json=body | {"stream": True}, timeout=120) as response:
        payloads = [line.removeprefix("data: ") for line in response.iter_lines()
                    if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    texts = [json.loads(p)["choices"][0]["text"] for p in payloads[:-1]]
    assert "".join(texts) == whole
    # 20 tokens at 4 per chunk: at most 5 text chunks plus the final one.
    assert 2 <= len([t for t in texts if t]) <= 6


def test_sigterm_drains_in_flight_request_then_exits_0(small_server):
    events: list = []
    stream = _stream_in_thread(small_server, 600, events)
    assert wait_for(lambda: len(events) > 2)
    small_server.process.send_signal(signal.SIGTERM)
    assert wait_for(lambda: httpx.get(f"{small_server.base_url}/health").status_code == 503, 10)
    refused = httpx.post(f"{small_server.base_url}/v1/completions", json={"prompt": "Hi"},
                         headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    stream.join(120)
    assert small_server.process.wait(timeout=60) == 0
    assert events[0] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[1:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks)  # the whole stream arrived


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_and_done(tmp_path, tiny_model):
    server = launch_server(tmp_path, "--model", tiny_model, "--max-model-len", "4096", "--shutdown-timeout", "1")
    try:
        streams = [[] for _ in range(2)]

        def stream(events: list[str]) -> None:
            body = {"prompt": "Tell me a story:", "max_tokens": 4000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
                events.extend(line[6:] for line in response.iter_lines() if line.startswith("data: "))

        threads = [threading.Thread(target=stream, args=(events,)) for events in streams]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: all(len(events) > 1 for events in streams), 120)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.process.wait(timeout=60) == 0
        for events in streams:  # 4000 tokens outlast the 1 s: each ends as an aborted stream
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "server_shutdown"
    finally:
        server.stop()


def test_a_port_in_use_is_an_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr and "Loading" not in result.stderr  # nothing loaded
