"""Heavier `kvserve router` runs on real replicas (slow): the shared-prefix workload, where
cache-aware routing must at least double round-robin's prefix-cache hit rate; a replica
SIGKILLed under load, which the router must route around; and --launch."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from replicas import client, launch_replicas, launch_router, scrape

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model):
    """Three replicas of `tiny-a` whose KV caches hold about 1,200 tokens each: three or four
    of the workload's 336-token prompts."""
    servers = launch_replicas(tmp_path_factory.mktemp("replicas"), tiny_model, ["tiny-a"] * 3,
                              "--kv-cache-memory", "600KiB")
    yield servers
    for server in servers:
        server.stop()


def _shared_prefix_hit_rate(router_url: str, servers, seed: int) -> tuple[float, list[float]]:
    """8 system prompts x 16 requests in a shuffled order, 4 at a time: the prefix-cache
    hit rate summed over the workers, and the requests each worker got."""
    rng = random.Random(seed)
    prefixes = [" ".join(f"t{rng.randrange(6, 500)}" for _ in range(320)) for _ in range(8)]
    prompts = [f"{p} " + " ".join(f"t{rng.randrange(6, 500)}" for _ in range(16))
               for p in prefixes for _ in range(16)]
    rng.shuffle(prompts)
    hits = lambda: sum(scrape(s.base_url, "kvserve:prefix_cache_hits") for s in servers)
    queries = lambda: sum(scrape(s.base_url, "kvserve:prefix_cache_queries") for s in servers)
    counts = lambda: [scrape(s.base_url, "kvserve:request_success") for s in servers]
    hits0, queries0, counts0 = hits(), queries(), counts()
    routed = client(router_url)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: routed.completions.create(model="tiny-a", prompt=p, max_tokens=1), prompts))
    return (hits() - hits0) / (queries() - queries0), [c - c0 for c, c0 in zip(counts(), counts0)]


def test_cache_aware_routing_doubles_the_prefix_cache_hit_rate(replicas, tmp_path_factory):
    servers = replicas[:3]
    rates = {}
    for seed, policy in enumerate(("round_robin", "cache_aware")):
        proc = launch_router(tmp_path_factory.mktemp(policy), "--policy", policy,
                             *[arg for s in servers for arg in ("--worker", s.base_url)])
        try:
            rates[policy], loads = _shared_prefix_hit_rate(proc.base_url, servers, seed)
            metrics = httpx.get(f"{proc.base_url}/metrics").text
        finally:
            proc.stop()
        mean = sum(loads) / len(loads)
        assert max(loads) <= 1.5 * mean, (policy, loads)
    assert 'kvserve_router:routing_decisions_total{branch="cache_hit",policy="cache_aware"}' in metrics
    assert rates["cache_aware"] >= 2 * rates["round_robin"], rates


def test_failover_when_a_replica_is_killed_under_load(replicas, tmp_path_factory):
    """Runs last: it kills the third replica."""
    servers = replicas[:3]
    proc = launch_router(tmp_path_factory.mktemp("failover"), "--policy", "round_robin",
                         *[arg for s in servers for arg in ("--worker", s.base_url)])
    try:
        routed = client(proc.base_url)
        results = []

        def one(i: int) -> str:
            if i == 16:
                servers[2].process.send_signal(signal.SIGKILL)
            try:
                stream = routed.completions.create(model="tiny-a", prompt=f"t{i + 6} t7", max_tokens=16,
                                                   stream=True, extra_body={"ignore_eos": True}) if i % 2 else None
                if stream is not None:
                    chunks = list(stream)
                    return "ok" if sum(len(c.choices) for c in chunks) == 16 else "error_event"
                routed.completions.create(model="tiny-a", prompt=f"t{i + 6} t7", max_tokens=16)
                return "ok"
            except openai.APIError as error:
                return f"error: {error}"

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(64)))
        failed = [r for r in results if r != "ok"]
        # At most the requests in flight on the killed replica fail (8 at a time, a third each).
        assert len(failed) <= 8, failed
        assert httpx.get(f"{proc.base_url}/health").status_code == 200
        workers = httpx.get(f"{proc.base_url}/workers").json()["workers"]
        assert [w["healthy"] for w in workers] == [True, True, False]
        for i in range(6):  # routed around it
            routed.completions.create(model="tiny-a", prompt="t9", max_tokens=1)
    finally:
        proc.stop()


def test_launch_starts_replicas_and_stops_them(tiny_model, tmp_path):
    proc = launch_router(tmp_path, "--launch", "2", "--", "--model", tiny_model,
                         "--served-model-name", "tiny-l", "--kv-cache-memory", "32MiB",
                         "--quantization", "none", "--no-compile-decode")
    try:
        deadline = time.monotonic() + 120
        while sum(w["healthy"] for w in httpx.get(f"{proc.base_url}/workers").json()["workers"]) < 2:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.5)
        reply = client(proc.base_url).completions.create(model="tiny-l", prompt="t5", max_tokens=2)
        assert reply.usage.completion_tokens == 2
        replica_urls = [w["url"] for w in httpx.get(f"{proc.base_url}/workers").json()["workers"]]
    finally:
        proc.stop()
    assert proc.process.returncode == 0
    for url in replica_urls:  # the replicas went with the router
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
