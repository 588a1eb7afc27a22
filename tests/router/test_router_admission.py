"""Admission against a stand-in worker that takes 0.2 s a request: with the worker saturated,
requests queue by priority, a full queue answers 429 with Retry-After, and an API key over
its rate limit gets 429 while another key goes through."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
from fake_workers import ThreadServer, fake_worker

from kvserve.entrypoints.cli import _build_router_only_parser
from kvserve.router.app import build_app
from kvserve.router.server import build_state, worker_specs


def _router(*flags: str):
    worker = ThreadServer(fake_worker("m", "slow"))
    args = _build_router_only_parser().parse_args(["router", "--worker", worker.url, *flags])
    server = ThreadServer(build_app(build_state(args, worker_specs(args, []))))
    yield server
    server.stop()
    worker.stop()


@pytest.fixture
def router():
    yield from _router("--max-outstanding-per-worker", "1", "--max-queue-size", "8")


@pytest.fixture
def token_limited_router():
    # 100 tokens at once, refilled at one a second: the test's requests never see a refill.
    yield from _router("--token-rate-limit", "1", "--token-rate-limit-burst", "100")


@pytest.fixture
def rate_limited_router():
    # Refills one request every 10 s: the 10 requests past the burst meet an empty bucket
    # however slowly the machine answers them.
    yield from _router("--rate-limit", "0.1", "--rate-limit-burst", "10")


async def _load(url: str) -> tuple[dict[int, list[float]], list[httpx.Response]]:
    """One request to fill the worker, then four low- (10) and four high-priority (-1)
    ones arriving in that order, then one more than the queue holds."""
    waits: dict[int, list[float]] = {10: [], -1: []}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def one(priority: int) -> httpx.Response:
            start = time.monotonic()
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x",
                                                                   "priority": priority})
            waits.setdefault(priority, []).append(time.monotonic() - start)
            return response

        tasks = [asyncio.create_task(one(0))]
        for priority in [10] * 4 + [-1] * 4:
            await asyncio.sleep(0.01)
            tasks.append(asyncio.create_task(one(priority)))
        await asyncio.sleep(0.05)
        overflow = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        responses = await asyncio.gather(*tasks)
    return waits, [*responses, overflow]


def test_priority_queue_and_overflow(router):
    waits, responses = asyncio.run(_load(router.url))
    assert [r.status_code for r in responses[:-1]] == [200] * 9
    assert responses[-1].status_code == 429 and responses[-1].headers["retry-after"] == "1"
    assert responses[-1].json()["error"]["code"] == "queue_full"
    assert statistics.median(waits[-1]) <= 0.5 * statistics.median(waits[10]), waits
    metrics = httpx.get(f"{router.url}/metrics").text
    assert "kvserve_router:queue_time_seconds_count 8.0" in metrics


def test_rate_limit_per_api_key(rate_limited_router):
    url = rate_limited_router.url
    responses = [httpx.post(f"{url}/tokenize", headers={"Authorization": "Bearer a"},
                            json={"model": "m", "prompt": "x"}) for _ in range(20)]
    statuses = [r.status_code for r in responses]
    # The stand-in worker has no /tokenize: what passes admission is its 404.
    assert 429 not in statuses[:10] and statuses.count(429) >= 9, statuses
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    other = httpx.post(f"{url}/tokenize", headers={"Authorization": "Bearer b"},
                       json={"model": "m", "prompt": "x"})
    assert other.status_code == 404


def test_token_rate_limit_counts_prompt_and_output_tokens(token_limited_router):
    url = token_limited_router.url
    # 40 characters (10 tokens) + 20 output tokens: 30 tokens a request, three fit in 100.
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 20}
    statuses = [httpx.post(f"{url}/tokenize", headers={"Authorization": "Bearer a"}, json=body).status_code
                for _ in range(4)]
    assert 429 not in statuses[:3] and statuses[3] == 429, statuses
    limited = httpx.post(f"{url}/tokenize", headers={"Authorization": "Bearer a"}, json=body)
    assert int(limited.headers["retry-after"]) >= 20  # 30 needed, 10 left, one a second
    huge = httpx.post(f"{url}/tokenize", headers={"Authorization": "Bearer b"},
                      json={"model": "m", "prompt": "x", "max_tokens": 50, "n": 3})
    assert huge.status_code == 429 and "151 tokens, more than the 100" in huge.json()["error"]["message"]
    assert httpx.post(f"{url}/tokenize", headers={"Authorization": "Bearer b"}, json=body).status_code != 429


def test_request_tokens_by_hand():
    from kvserve.router.admission import request_tokens

    assert request_tokens({"prompt": "abcdefghi", "max_tokens": 5}) == 3 + 5
    assert request_tokens({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "n": 2}) == 5 + 2 * 2 * 2
    assert request_tokens({"prompt": [1, 2, 3, 4]}) == 4
    assert request_tokens({"messages": [{"role": "user", "content": "a" * 10}, {"role": "system", "content": "b"}],
                           "max_completion_tokens": 7}) == 3 + 1 + 7
