"""The server under mixed valid, malformed and abandoned traffic: no 5xx, every valid request
complete, the engine idle again within seconds, and the server still answering.

The default run has a short version. The full one (1,000 requests at concurrency 32, run
twice to compare resident memory, then SIGTERM with streams in flight) is slow-marked:

    python -m pytest -m slow tests/reliability
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

import traffic
from tests.entrypoints.server_process import launch_server


def _gauges(server) -> dict[str, float]:
    names = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:num_sequences_running",
             "kvserve:num_sequences_waiting", "kvserve:kv_cache_usage_perc")
    values = dict.fromkeys(names, 0.0)
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0]
        if name in values:
            values[name] += float(line.split()[-1])
    return values


def _assert_idle_within(server, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(_gauges(server).values()):
        assert time.monotonic() < deadline, _gauges(server)
        time.sleep(0.1)


def _assert_clean(server, report: traffic.Report, num_requests: int) -> None:
    assert not report.server_errors(), sorted(set(report.statuses))
    assert not report.failures, report.failures[:5]
    assert report.valid_done > 0 and len(report.statuses) == num_requests
    _assert_idle_within(server, 10)
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    assert "Traceback" not in server.log()


def test_short_soak(tmp_path):
    server = launch_server(tmp_path, "--max-model-len", "1024", "--header-read-timeout", "1",
                           "--body-read-timeout", "1")
    try:
        report = asyncio.run(traffic.run(server.base_url, num_requests=24, concurrency=8,
                                         num_abandoned=2, num_timeouts=2, num_slow=2))
        _assert_clean(server, report, 24)
    finally:
        server.stop()


@pytest.mark.slow
def test_full_soak_twice_then_sigterm_with_streams_in_flight(tmp_path):
    server = launch_server(tmp_path, "--max-model-len", "1024", "--header-read-timeout", "2",
                           "--body-read-timeout", "2", "--shutdown-timeout", "60")
    try:
        resident = [traffic.resident_kib(server.process.pid)]
        print(f"soak: resident before {resident[0] / 1024:.0f} MiB")
        for run in range(2):
            started = time.monotonic()
            report = asyncio.run(traffic.run(server.base_url, num_requests=1000, concurrency=32,
                                             num_abandoned=50, num_timeouts=20, num_slow=20, seed=run))
            elapsed = time.monotonic() - started
            _assert_clean(server, report, 1000)
            resident.append(traffic.resident_kib(server.process.pid))
            print(f"soak run {run}: {len(report.statuses) / elapsed:.1f} requests/s over {elapsed:.0f} s, "
                  f"{report.valid_done} valid done, valid latency p50 "
                  f"{report.valid_latency_percentile(50):.2f} s p99 {report.valid_latency_percentile(99):.2f} s, "
                  f"resident after {resident[-1] / 1024:.0f} MiB")
        # The first run warms allocator pools and caches; the second must not keep growing.
        assert resident[2] <= resident[1] * 1.10, resident

        streams: list[list[str]] = [[] for _ in range(4)]

        def stream(events: list[str]) -> None:
            body = {"prompt": "Tell me a story:", "max_tokens": 30, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))

        threads = [threading.Thread(target=stream, args=(events,)) for events in streams]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not all(streams):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert server.process.wait(timeout=60) == 0
        assert all(events[-1] == "data: [DONE]" for events in streams)
    finally:
        server.stop()
