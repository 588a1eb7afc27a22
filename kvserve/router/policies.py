"""Routing policies: which healthy worker of a model gets a request.

Each answers (worker, branch); the branch names why, for the routing-decision metric.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.router.metrics import RouterMetrics
from kvserve.router.prefix_tree import PrefixTree
from kvserve.router.workers import Worker


class Policy:
    name: str

    def choose(self, model: str, workers: list[Worker], key: Sequence) -> tuple[Worker, str]:
        raise NotImplementedError

    def forget(self, worker: Worker) -> None:
        """The worker was taken out: what the policy remembers of it is stale."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.counter = itertools.count()

    def choose(self, model: str, workers: list[Worker], key: Sequence) -> tuple[Worker, str]:
        return workers[next(self.counter) % len(workers)], "round_robin"


def least_loaded(workers: list[Worker]) -> Worker:
    return min(workers, key=lambda w: w.outstanding)


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def choose(self, model: str, workers: list[Worker], key: Sequence) -> tuple[Worker, str]:
        return least_loaded(workers), "least_outstanding"


@dataclass(frozen=True)
class CacheAwareSettings:
    # Route to the best-matching worker when at least this fraction of the prompt matches.
    cache_threshold: float = 0.3
    # Load is imbalanced (route to the least loaded) when max - min outstanding exceeds the
    # absolute threshold and max exceeds the relative one times min, as in sgl-router.
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2 ** 24  # characters (or token ids) remembered per worker


class CacheAware(Policy):
    """SGLang's cache-aware policy: keep each prefix on the worker that has it cached,
    unless load is imbalanced; a prompt matching nothing goes to the worker whose tree is
    smallest, which spreads new prefixes over the workers."""

    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.trees: dict[str, PrefixTree] = {}  # model -> its workers' tree

    def choose(self, model: str, workers: list[Worker], key: Sequence) -> tuple[Worker, str]:
        tree = self.trees.setdefault(model, PrefixTree(self.settings.max_tree_size))
        loads = [w.outstanding for w in workers]
        imbalanced = (max(loads) - min(loads) > self.settings.balance_abs_threshold
                      and max(loads) > self.settings.balance_rel_threshold * min(loads))
        if imbalanced:
            worker, branch = least_loaded(workers), "balance"
        else:
            matched, tenants = tree.match(key)
            self.metrics.prefix_match_length.observe(matched)
            candidates = [w for w in workers if w.url in tenants]
            if candidates and matched >= self.settings.cache_threshold * len(key):
                worker, branch = least_loaded(candidates), "cache_hit"
            else:
                worker = min(workers, key=lambda w: (tree.size_of.get(w.url, 0), w.outstanding))
                branch = "cache_miss"
        tree.insert(key, worker.url)
        return worker, branch

    def forget(self, worker: Worker) -> None:
        for tree in self.trees.values():
            tree.remove_tenant(worker.url)


def make_policy(name: str, settings: CacheAwareSettings, metrics: RouterMetrics) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "cache_aware":
        return CacheAware(settings, metrics)
    raise ValueError(f"unknown policy {name!r}")


POLICIES = ("cache_aware", "round_robin", "least_outstanding")
