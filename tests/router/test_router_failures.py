"""The router's failure paths against stand-in workers: a dead worker is skipped before the
first byte, a worker dying mid-stream ends the stream with an error event, no healthy worker
is a 503, a server that is not an OpenAI server is kept out, a worker that returns is taken
back, and SIGTERM lets the requests in flight finish."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_workers import ThreadServer, fake_worker, free_url, health_only
from replicas import launch_router

from kvserve.entrypoints.cli import _build_router_only_parser
from kvserve.router.app import build_app
from kvserve.router.server import build_state, worker_specs


def _router(*flags: str) -> ThreadServer:
    args = _build_router_only_parser().parse_args(["router", "--health-check-interval", "0.2", *flags])
    state = build_state(args, worker_specs(args, []))
    server = ThreadServer(build_app(state))
    server.state = state
    return server


@pytest.fixture
def servers():
    started: list[ThreadServer] = []
    yield started
    for server in started:
        server.stop()


def _workers(router: ThreadServer) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(f"{router.url}/workers").json()["workers"]}


def test_a_dead_worker_is_skipped_and_taken_out(servers, tmp_path):
    live = ThreadServer(fake_worker("m"))
    dead_url = free_url()
    router = _router("--policy", "round_robin", "--config", _config(tmp_path, {"m": [dead_url, live.url]}))
    servers += [live, router]
    # The first health round already took the dead one out; make it look healthy again to
    # exercise the retry: its connection is refused, the request goes to the live worker.
    router.state.pool.workers[0].healthy = True
    for _ in range(2):
        response = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 200 and response.json()["worker"] == "ok"
    assert not _workers(router)[dead_url]["healthy"]
    assert "connection" in _workers(router)[dead_url]["last_error"]
    metrics = httpx.get(f"{router.url}/metrics").text
    assert f'kvserve_router:retries_total{{worker="{dead_url}"}} 1.0' in metrics


def test_mid_stream_failure_ends_with_an_error_event(servers):
    dying = ThreadServer(fake_worker("m", "die_mid_stream"))
    router = _router("--worker", dying.url)
    servers += [dying, router]
    with httpx.stream("POST", f"{router.url}/v1/completions",
                      json={"model": "m", "prompt": "x", "stream": True}, timeout=10) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
    assert json.loads(events[1][6:])["error"]["code"] == "worker_failed"
    assert events[-1] == "data: [DONE]"
    assert _workers(router)[dying.url]["outstanding"] == 0


def test_no_healthy_worker_is_503_and_unknown_model_404(servers, tmp_path):
    not_openai = ThreadServer(health_only())
    router = _router("--config", _config(tmp_path, {"m": [free_url(), not_openai.url]}))
    servers += [not_openai, router]
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status_code == 503 and "no healthy worker" in response.json()["error"]["message"]
    assert httpx.get(f"{router.url}/health").status_code == 503
    assert "not a kvserve/OpenAI server" in _workers(router)[not_openai.url]["last_error"]
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "other", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["message"].endswith("Available models: m")


def test_a_worker_back_after_failing_is_taken_back(servers):
    worker = ThreadServer(fake_worker("m"))
    router = _router("--worker", worker.url, "--health-failure-threshold", "1", "--health-max-backoff", "0.4")
    servers.append(router)
    assert _workers(router)[worker.url]["healthy"]
    port = worker.port
    worker.stop()
    _wait(lambda: not _workers(router)[worker.url]["healthy"])
    servers.append(ThreadServer(fake_worker("m"), port))
    _wait(lambda: _workers(router)[worker.url]["healthy"])


def _wait(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def _config(tmp_path, models: dict[str, list[str]]) -> str:
    path = tmp_path / "router.yaml"
    path.write_text("models:\n" + "".join(f"  {m}: [{', '.join(urls)}]\n" for m, urls in models.items()))
    return str(path)


def test_sigterm_drains_requests_in_flight(tmp_path):
    worker = ThreadServer(fake_worker("m", "slow"))
    router = launch_router(tmp_path, "--worker", worker.url)
    try:
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{router.base_url}/v1/completions",
                                    json={"model": "m", "prompt": "x"}, timeout=10)
            _wait(lambda: worker.server.config.app.state.requests == 1)
            router.process.send_signal(signal.SIGTERM)
            assert in_flight.result().status_code == 200
        assert router.process.wait(timeout=10) == 0
        assert "received SIGTERM: draining 1 requests in flight" in router.log()
    finally:
        router.stop()
        worker.stop()


def test_an_adapter_goes_to_the_worker_that_runs_it(servers):
    """Two workers serve base model m and adapter sql; only the second runs sql (its
    lora_requests_info says so): round-robin alternates m's requests and sends every sql
    request to the second, where the adapter's weights already are."""
    idle_app = fake_worker("m", adapters=("sql",))
    running_app = fake_worker("m", adapters=("sql",), running_adapters=("sql",))
    idle, running = ThreadServer(idle_app), ThreadServer(running_app)
    servers += [idle, running]
    router = _router("--worker", idle.url, "--worker", running.url, "--policy", "round_robin")
    servers.append(router)
    assert sorted(m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]) == ["m", "sql"]
    for model in ["sql"] * 6 + ["m"] * 4:
        assert httpx.post(f"{router.url}/v1/completions", json={"model": model, "prompt": "x"}).status_code == 200
    assert idle_app.state.models_requested == ["m", "m"]
    assert running_app.state.models_requested == ["sql"] * 6 + ["m", "m"]
