"""`kvserve bench serve`: metric math on hand-computed records, then end to end against a
real `kvserve serve` on a free loopback port, checking that the numbers agree with each other."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.benchmarks.serve import arrival_offsets
from kvserve.benchmarks.serve_datasets import random_prompts, shared_prefix_prompts, sharegpt_prompts
from kvserve.benchmarks.serve_metrics import (
    RequestRecord,
    compute_metrics,
    summarize_ms,
)
from kvserve.entrypoints.cli import main

# ---- metric math on synthetic records ----

def test_summary_matches_hand_computed_percentiles():
    stats = summarize_ms([0.010, 0.020, 0.030, 0.040, 0.100])
    # Linear interpolation between order statistics: p90 sits at rank 3.6, p99 at rank 3.96.
    assert stats == pytest.approx({"mean": 40.0, "p50": 30.0, "p90": 76.0, "p99": 97.6})
    assert summarize_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_is_time_after_the_first_token_per_later_token():
    record = RequestRecord(10, 5, ttft_s=0.1, itl_s=[0.1] * 4, e2e_s=0.5, output_tokens=5)
    assert record.tpot_s == pytest.approx(0.1)
    assert RequestRecord(10, 1, ttft_s=0.1, e2e_s=0.1, output_tokens=1).tpot_s is None
    assert RequestRecord(10, 5, error="HTTP 500").tpot_s is None


def test_aggregate_goodput_and_throughput_by_hand():
    records = [
        # ttft 100 ms, tpot 50 ms: meets both SLOs
        RequestRecord(10, 3, start_s=0.0, ttft_s=0.1, itl_s=[0.05, 0.05], e2e_s=0.2, output_tokens=3),
        # ttft 300 ms: misses the TTFT SLO
        RequestRecord(20, 3, start_s=0.5, ttft_s=0.3, itl_s=[0.1, 0.1], e2e_s=0.5, output_tokens=3),
        # one token, so no TPOT: meets both (as vLLM counts it)
        RequestRecord(30, 1, start_s=1.0, ttft_s=0.2, e2e_s=0.2, output_tokens=1),
        RequestRecord(40, 3, start_s=1.5, error="HTTP 429: queue full"),
    ]
    metrics = compute_metrics(records, duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=60)
    assert metrics["completed"] == 3 and metrics["failed"] == 1
    assert metrics["errors"] == ["HTTP 429: queue full"]
    assert metrics["total_input_tokens"] == 60 and metrics["total_output_tokens"] == 7
    assert metrics["request_throughput"] == pytest.approx(1.5)
    assert metrics["output_throughput"] == pytest.approx(3.5)
    assert metrics["total_token_throughput"] == pytest.approx(33.5)
    assert metrics["good_requests"] == 2 and metrics["goodput"] == pytest.approx(1.0)
    assert metrics["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert metrics["tpot_ms"] == pytest.approx({"mean": 75.0, "p50": 75.0, "p90": 95.0, "p99": 99.5})
    assert metrics["itl_ms"]["p50"] == pytest.approx(75.0)
    assert metrics["e2e_ms"]["p50"] == pytest.approx(200.0)
    assert compute_metrics(records, 2.0)["goodput"] is None


def test_poisson_arrivals():
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    offsets = arrival_offsets(4000, 10.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(0.1, rel=0.05)
    assert arrival_offsets(50, 10.0, seed=1) == arrival_offsets(50, 10.0, seed=1)


def test_random_prompts_follow_the_ranges_and_the_seed():
    prompts = random_prompts(50, (16, 48), (8, 16), (1000, 2000), seed=3)
    assert prompts == random_prompts(50, (16, 48), (8, 16), (1000, 2000), seed=3)
    assert all(16 <= p.prompt_tokens == len(p.prompt) <= 48 for p in prompts)
    assert all(8 <= p.max_tokens <= 16 for p in prompts)
    assert all(1000 <= token < 2000 for p in prompts for token in p.prompt)


def test_shared_prefix_prompts_spread_evenly_over_their_prefixes():
    prompts = shared_prefix_prompts(40, 4, 30, (5, 9), (8, 16), (1000, 2000), seed=2)
    prefixes = [tuple(p.prompt[:30]) for p in prompts]
    assert len(set(prefixes)) == 4 and all(prefixes.count(prefix) == 10 for prefix in set(prefixes))
    assert all(35 <= p.prompt_tokens == len(p.prompt) <= 39 for p in prompts)
    assert all(1000 <= token < 2000 for p in prompts for token in p.prompt)
    assert len(set(prefixes[:8])) > 1  # shuffled: the groups interleave


def _write_sharegpt(path) -> None:
    conversations = [
        [("human", "Name three primary colors, please."), ("gpt", "Red, yellow and blue are the primary colors.")],
        [("system", "Be brief."), ("human", "What is the capital of France?"),
         ("gpt", "The capital of France is Paris.")],
        [("human", "hi"), ("gpt", "Hello! How can I help you today?")],  # prompt too short: skipped
        [("human", "Only a question, never answered.")],  # no answer: skipped
        [("human", "Give me a word that rhymes with cat."), ("gpt", "Hat rhymes with cat, and so does bat.")],
    ]
    path.write_text(json.dumps(
        [{"id": str(i), "conversations": [{"from": who, "value": text} for who, text in turns]}
         for i, turns in enumerate(conversations)]
    ))


def test_sharegpt_takes_first_exchange_and_skips_short_ones(tmp_path):
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path)

    async def count_words(text: str) -> int:
        return len(text.split())

    prompts = asyncio.run(sharegpt_prompts(str(path), 3, 0, count_words))
    assert sorted(p.prompt for p in prompts) == [
        "Give me a word that rhymes with cat.", "Name three primary colors, please.",
        "What is the capital of France?",
    ]
    answers = {"Give": 8, "Name": 8, "What": 6}
    assert all(p.max_tokens == answers[p.prompt.split()[0]] for p in prompts)
    with pytest.raises(ValueError, match="only 3 usable"):
        asyncio.run(sharegpt_prompts(str(path), 4, 0, count_words))


# ---- the client against a minimal streaming server ----

@contextlib.asynccontextmanager
async def _bench_client(app):
    """An OpenAIClient against `app` (an aiohttp web.Application) served on a free loopback port."""
    from aiohttp import web

    from kvserve.benchmarks.serve import OpenAIClient, client_session

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with client_session() as session:
            yield OpenAIClient(session, f"http://127.0.0.1:{port}", None, "completions")
    finally:
        await runner.cleanup()


def test_waits_until_the_server_compiled_its_decode_graphs():
    """A kvserve server answers before its CPU decode graphs are compiled: the benchmark
    polls /metrics until the gauge reads 0, and does not wait on a server without it."""
    from aiohttp import web

    readings = ["2.0", "1.0", "0.0"]
    served = []

    async def metrics(request: web.Request) -> web.Response:
        value = readings[min(len(served), len(readings) - 1)]
        served.append(value)
        return web.Response(text=f'# TYPE kvserve:decode_graphs_pending gauge\n'
                                 f'kvserve:decode_graphs_pending{{model_name="m"}} {value}\n')

    async def run(with_metrics: bool) -> None:
        app = web.Application()
        if with_metrics:
            app.router.add_get("/metrics", metrics)
        async with _bench_client(app) as client:
            await client.wait_for_decode_graphs(timeout_s=30, poll_s=0.01)

    asyncio.run(run(with_metrics=True))
    assert served == ["2.0", "1.0", "0.0"]
    asyncio.run(run(with_metrics=False))  # a 404: returns at once


def test_each_request_gets_its_own_connection():
    """No keep-alive reuse: a server closing idle connections (llama-server does) must not
    fail requests that raced the close. Checked by the connection each request came on."""
    from aiohttp import web

    from kvserve.benchmarks.serve_datasets import BenchPrompt

    peers = []

    async def completions(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b"):
            await response.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": 2}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    async def run() -> list[RequestRecord]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        records = [RequestRecord(3, 2) for _ in range(5)]
        async with _bench_client(app) as client:
            for record in records:  # one after another: each could have reused the last
                await client.stream(BenchPrompt([1, 2, 3], 3, 2), record)
        return records

    records = asyncio.run(run())
    assert [r.error for r in records] == [None] * 5 and all(r.output_tokens == 2 for r in records)
    assert len(set(peers)) == 5


# ---- end to end against a real `kvserve serve` ----

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "WARNING", "serve",
             "--port", str(port), "--kv-cache-memory", "256MiB", "--max-model-len", "4096",
             "--no-compile-decode"],
            stdout=log, stderr=log,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert process.poll() is None, f"server exited {process.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"server not healthy in time:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _bench(url: str, tmp_path, capsys, *args: str) -> tuple[dict, str]:
    """The real command line, in-process (the server is the separate process under test)."""
    output = tmp_path / "result.json"
    code = main(["--log-level", "WARNING", "bench", "serve", "--base-url", url,
                 "--output-json", str(output), *args])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    return json.loads(output.read_text()), stdout


def _assert_consistent(run: dict, num_prompts: int, ignore_eos: bool) -> None:
    requests = run["requests"]
    assert run["completed"] == len(requests) == num_prompts and run["failed"] == 0
    assert run["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
    assert run["total_input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    for r in requests:
        assert r["error"] is None
        assert 0 < r["output_tokens"] <= r["max_tokens"]
        if ignore_eos:
            assert r["output_tokens"] == r["max_tokens"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        # One gap per later content chunk; a chunk carries at least one token.
        assert len(r["itl_s"]) <= r["output_tokens"] - 1
        assert r["ttft_s"] + sum(r["itl_s"]) == pytest.approx(r["e2e_s"], abs=1e-6)
        if r["output_tokens"] > 1:
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
    if ignore_eos:
        assert run["total_output_tokens"] == sum(r["max_tokens"] for r in requests)
    duration = run["duration_s"]
    assert duration >= max(r["start_s"] + r["e2e_s"] for r in requests)
    assert run["request_throughput"] == pytest.approx(num_prompts / duration)
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / duration)
    assert run["total_token_throughput"] == pytest.approx(
        (run["total_input_tokens"] + run["total_output_tokens"]) / duration)
    ttfts = [r["ttft_s"] * 1000 for r in requests]
    assert run["ttft_ms"]["mean"] == pytest.approx(sum(ttfts) / len(ttfts))
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = run[f"{name}_ms"]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]


def _max_in_flight(requests: list[dict]) -> int:
    return max(
        sum(o["start_s"] <= r["start_s"] < o["start_s"] + o["e2e_s"] for o in requests) for r in requests
    )


def test_random_completions_all_at_once(server_url, tmp_path, capsys):
    run, stdout = _bench(
        server_url, tmp_path, capsys, "--num-prompts", "8", "--input-len", "16", "48", "--output-len", "8", "16",
        "--request-rate", "inf", "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
    )
    _assert_consistent(run, 8, ignore_eos=True)
    assert all(16 <= r["prompt_tokens"] <= 48 for r in run["requests"])
    assert run["request_rate"] == math.inf and run["ignore_eos"] is True
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: all good
    assert _max_in_flight(run["requests"]) > 1  # all at once really overlaps
    assert "TTFT" in stdout and "8 completed, 0 failed" in stdout
    kv = run["kv_cache"]  # sampled from the server's /debug/kv during the run
    assert kv["samples"] >= 2 and 0 <= kv["peak_blocks_used"] <= kv["blocks_total"]
    assert kv["preemptions"] >= 0 and 0 <= kv["prefix_cache_hit_rate"] <= 1
    assert "KV cache: peak" in stdout


@pytest.mark.slow  # ~25 s on 2 cores; test_random_completions_all_at_once covers the run itself
def test_sweep_poisson_and_capped_concurrency_writes_json_and_plot(server_url, tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    result, _ = _bench(
        server_url, tmp_path, capsys, "--num-prompts", "6", "--input-len", "16", "48", "--output-len", "8", "16",
        "--sweep", "4,inf", "--max-concurrency", "3", "--seed", "1", "--plot", str(plot),
    )
    assert [run["request_rate"] for run in result["sweep"]] == [4.0, math.inf]
    for run in result["sweep"]:
        _assert_consistent(run, 6, ignore_eos=True)
        assert _max_in_flight(run["requests"]) <= 3
    poisson = result["sweep"][0]["requests"]
    assert max(r["start_s"] for r in poisson) > 0.2  # arrivals spread out
    assert plot.read_bytes().startswith(b"\x89PNG") and result["plot"] == str(plot)


def test_sharegpt_chat_uses_reference_answer_lengths(server_url, tmp_path, capsys):
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path)
    run, _ = _bench(server_url, tmp_path, capsys, "--endpoint", "chat", "--dataset", f"sharegpt:{path}",
                    "--num-prompts", "3", "--request-rate", "inf")
    _assert_consistent(run, 3, ignore_eos=False)
    assert run["ignore_eos"] is False
    answers = ["Red, yellow and blue are the primary colors.", "The capital of France is Paris.",
               "Hat rhymes with cat, and so does bat."]
    counts = [httpx.post(f"{server_url}/tokenize", json={"prompt": a}).json()["count"] for a in answers]
    assert sorted(r["max_tokens"] for r in run["requests"]) == sorted(counts)
