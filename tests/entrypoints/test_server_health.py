"""Gauges and /health tell the truth: requests and sequences are counted apart, n samples of
a request are admitted only when they all fit --max-num-seqs, and /health answers 503 while
the engine, with requests in flight, makes no progress.

The engine core runs in its own process here, so that stopping it (SIGSTOP) stalls the
engine for real while the server stays up. The model is the tiny one: its steps take
milliseconds, so requests are long enough (in tokens) for each state to last seconds."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_process import launch_server
from tests.polling import wait_for

WAIT_S = 180.0  # streams and scrapes share 2 busy cores with the server
STALL_TIMEOUT_S = 3.0  # far above the tiny model's longest step on a busy 2-core machine


@pytest.fixture(scope="module")
def core_server(tmp_path_factory, tiny_model):
    proc = launch_server(tmp_path_factory.mktemp("health"), "--model", tiny_model, "--multiprocess-engine-core",
                         "--max-num-seqs", "4", "--max-model-len", "2048",
                         "--health-stall-timeout", str(STALL_TIMEOUT_S))
    yield proc
    proc.stop()


def gauges(server) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        for name in ("requests_running", "requests_waiting", "sequences_running", "sequences_waiting"):
            if line.startswith(f"kvserve:num_{name}{{"):
                values[name] = float(line.split()[-1])
    return values


def stream_in_thread(server, body: dict, events: list) -> threading.Thread:
    """A streaming completion read on a thread; `events` gets each SSE payload."""

    def run() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=300,
                          json={"prompt": "Tell me a story:", "stream": True, "ignore_eos": True} | body) as response:
            assert response.status_code == 200
            events.extend(line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def finish_reasons(events: list[str]) -> dict[int, str]:
    assert events[-1] == "[DONE]"
    reasons = {}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    return reasons


def engine_core_pid(server) -> int:
    """The engine core process: the server's spawned child (not multiprocessing's helpers)."""
    cores = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or it is gone
        if parent == server.process.pid and b"spawn_main" in cmdline:
            cores.append(int(entry))
    assert len(cores) == 1, cores
    return cores[0]


def test_gauges_count_requests_and_sequences_apart(core_server):
    scrapes: list[dict[str, float]] = []

    def scrape() -> dict[str, float]:
        scrapes.append(gauges(core_server))
        return scrapes[-1]

    first, second, third = [], [], []
    streams = [stream_in_thread(core_server, {"n": 3, "max_tokens": 600, "temperature": 0.8}, first)]
    assert wait_for(lambda: len(first) > 2, WAIT_S)  # its prompt has forked into 3 running samples
    # 3 + 3 samples exceed --max-num-seqs 4: the second waits, and the third behind it.
    streams.append(stream_in_thread(core_server, {"n": 3, "max_tokens": 200, "temperature": 0.8}, second))
    assert wait_for(lambda: scrape()["requests_waiting"] == 1, WAIT_S)
    streams.append(stream_in_thread(core_server, {"max_tokens": 200, "temperature": 0}, third))
    assert wait_for(lambda: scrape()["requests_waiting"] == 2, WAIT_S)
    assert scrapes[-1] == {"requests_running": 1, "requests_waiting": 2,
                           "sequences_running": 3, "sequences_waiting": 2}
    assert not second and not third  # nothing of theirs ran
    # Once the first ends, both run: 2 requests, 3 + 1 sequences.
    assert wait_for(lambda: scrape() == {"requests_running": 2, "requests_waiting": 0,
                                         "sequences_running": 4, "sequences_waiting": 0}, WAIT_S)
    for stream in streams:
        stream.join(300)
    assert finish_reasons(first) == finish_reasons(second) == {0: "length", 1: "length", 2: "length"}
    assert finish_reasons(third) == {0: "length"}
    assert wait_for(lambda: scrape() == dict.fromkeys(scrapes[-1], 0.0), WAIT_S)
    assert max(s["sequences_running"] for s in scrapes) == 4  # never past --max-num-seqs


def test_health_is_503_while_the_engine_makes_no_progress(core_server):
    url = f"{core_server.base_url}/health"
    time.sleep(STALL_TIMEOUT_S + 0.5)  # idle for longer than the timeout: still healthy
    assert httpx.get(url).status_code == 200
    events: list[str] = []
    stream = stream_in_thread(core_server, {"max_tokens": 600, "temperature": 0}, events)
    statuses, deadline = [], time.monotonic() + 180
    while len(events) < 10:  # working: healthy from the first request on
        assert time.monotonic() < deadline
        statuses.append(httpx.get(url).status_code)
        time.sleep(0.02)
    assert set(statuses) == {200}

    core = engine_core_pid(core_server)
    os.kill(core, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while (reply := httpx.get(url)).status_code == 200:
            assert time.monotonic() - stopped < STALL_TIMEOUT_S + 30, "never reported the stall"
            time.sleep(0.05)
        stalled_after = time.monotonic() - stopped
        assert reply.status_code == 503 and reply.json()["status"] == "stalled"
        assert reply.json()["seconds_without_progress"] >= STALL_TIMEOUT_S  # rounded to a tenth
        assert stalled_after > STALL_TIMEOUT_S - 0.5  # not before the timeout (one step may precede it)
    finally:
        os.kill(core, signal.SIGCONT)
    assert wait_for(lambda: httpx.get(url).status_code == 200, 60)
    stream.join(300)
    assert finish_reasons(events) == {0: "length"}
    assert wait_for(lambda: gauges(core_server)["requests_running"] == 0, WAIT_S)
    assert httpx.get(url).status_code == 200
