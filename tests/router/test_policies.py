"""Routing policies on fake workers: round-robin, least outstanding, cache-aware branches."""

from __future__ import annotations

from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import CacheAwareSettings, make_policy
from kvserve.router.workers import Worker


def _workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}", frozenset({"m"}), healthy=True) for i in range(n)]


def test_round_robin_and_least_outstanding():
    workers = _workers(3)
    rr = make_policy("round_robin", CacheAwareSettings(), RouterMetrics())
    assert [rr.choose("m", workers, "x")[0].url for _ in range(4)] == \
        ["http://w0", "http://w1", "http://w2", "http://w0"]
    workers[0].outstanding, workers[1].outstanding, workers[2].outstanding = 3, 1, 2
    lo = make_policy("least_outstanding", CacheAwareSettings(), RouterMetrics())
    assert lo.choose("m", workers, "x")[0].url == "http://w1"


def test_cache_aware_keeps_a_prefix_on_its_worker_and_spreads_new_ones():
    workers = _workers(3)
    policy = make_policy("cache_aware", CacheAwareSettings(), RouterMetrics())
    prefixes = [f"system prompt {i}: " + "lorem ipsum " * 20 for i in range(6)]
    first = {}
    for p in prefixes:
        worker, branch = policy.choose("m", workers, p + "question 0")
        assert branch == "cache_miss"
        first[p] = worker.url
    assert sorted(first.values()).count("http://w0") == 2  # smallest tree first: two each
    for p in prefixes:
        for q in range(1, 5):
            worker, branch = policy.choose("m", workers, p + f"question {q}")
            assert (worker.url, branch) == (first[p], "cache_hit")


def test_cache_aware_balances_when_load_is_imbalanced():
    workers = _workers(2)
    policy = make_policy("cache_aware", CacheAwareSettings(balance_abs_threshold=4,
                                                           balance_rel_threshold=1.5), RouterMetrics())
    home, _ = policy.choose("m", workers, "shared prefix " * 10)
    other = next(w for w in workers if w is not home)
    home.outstanding = 5  # 5 - 0 > 4 and 5 > 1.5 * 0
    worker, branch = policy.choose("m", workers, "shared prefix " * 10 + "more")
    assert (worker, branch) == (other, "balance")
    home.outstanding, other.outstanding = 5, 3  # within the absolute threshold
    worker, branch = policy.choose("m", workers, "shared prefix " * 10 + "again")
    assert branch == "cache_hit"


def test_cache_aware_short_matches_are_misses_and_forget_drops_a_worker():
    workers = _workers(2)
    policy = make_policy("cache_aware", CacheAwareSettings(cache_threshold=0.5), RouterMetrics())
    home, _ = policy.choose("m", workers, "abcdefgh")
    _, branch = policy.choose("m", workers, "abc" + "z" * 20)  # 3 of 23 match
    assert branch == "cache_miss"
    policy.forget(home)
    _, branch = policy.choose("m", [home], "abcdefgh")
    assert branch == "cache_miss"
