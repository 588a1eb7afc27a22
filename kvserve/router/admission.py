"""Admission: per-API-key rate limits, and a bounded priority queue for requests that find
every worker of their model saturated.

A worker is saturated at `max_outstanding` requests in flight (no limit by default: the
workers queue themselves). Waiting requests leave the queue by priority (lower first, as
the `priority` field means to vLLM and kvserve serve), then arrival.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvserve.router.errors import RouterError
from kvserve.router.metrics import RouterMetrics
from kvserve.router.workers import Worker, WorkerPool


@dataclass(order=True)
class _Waiter:
    priority: int
    arrival: int
    model: str = field(compare=False)
    ready: asyncio.Future = field(compare=False)


class ClientGone(Exception):
    """The client disconnected while its request waited."""


class AdmissionQueue:
    def __init__(self, pool: WorkerPool, max_outstanding: int | None, max_queue: int,
                 metrics: RouterMetrics) -> None:
        self.pool = pool
        self.max_outstanding = max_outstanding
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiters: list[_Waiter] = []
        self.arrivals = itertools.count()

    def has_room(self, worker: Worker) -> bool:
        return self.max_outstanding is None or worker.outstanding < self.max_outstanding

    def _free_slots(self, model: str) -> float:
        if self.max_outstanding is None:
            return math.inf
        return sum(max(0, self.max_outstanding - w.outstanding) for w in self.pool.healthy_for(model))

    async def admit(self, model: str, priority: int,
                    wait_disconnect: Callable[[], Awaitable[None]]) -> None:
        """Return when a worker of the model has room; queue until then. A request finding
        no healthy worker at all goes on (the forwarder answers 503 at once)."""
        if not self.pool.healthy_for(model) or (
                self._free_slots(model) > 0 and not any(w.model == model for w in self.waiters)):
            return
        arrival, start = next(self.arrivals), time.monotonic()
        self._refuse_when_full(model)
        try:
            while True:
                waiter = _Waiter(priority, arrival, model, asyncio.get_running_loop().create_future())
                heapq.heappush(self.waiters, waiter)
                self.metrics.queue_depth.set(len(self.waiters))
                await self._wait(waiter, wait_disconnect)
                # A woken waiter can lose its slot to a request that arrived meanwhile: it
                # goes back to its place in the queue (same priority and arrival).
                if self._free_slots(model) > 0 or not self.pool.healthy_for(model):
                    return
                self._refuse_when_full(model)
        finally:
            self.metrics.queue_time.observe(time.monotonic() - start)

    def _refuse_when_full(self, model: str) -> None:
        if len(self.waiters) >= self.max_queue:
            raise RouterError(429, f"all workers of {model!r} are busy and {self.max_queue} "
                              "requests already wait; retry later", type="rate_limit_error",
                              code="queue_full", headers={"Retry-After": "1"})

    async def _wait(self, waiter: _Waiter, wait_disconnect: Callable[[], Awaitable[None]]) -> None:
        gone = asyncio.ensure_future(wait_disconnect())
        try:
            await asyncio.wait({waiter.ready, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if waiter in self.waiters:
                self.waiters.remove(waiter)
                heapq.heapify(self.waiters)
                self.metrics.queue_depth.set(len(self.waiters))
        if not waiter.ready.done():
            raise ClientGone()

    def wake(self) -> None:
        """Let out as many waiters, best first, as their models' workers have room for:
        called when a request ends and after each round of health checks."""
        if not self.waiters:
            return
        free: dict[str, float] = {}
        woken = []
        for waiter in sorted(self.waiters):
            slots = free.setdefault(waiter.model, self._free_slots(waiter.model))
            if slots > 0 or not self.pool.healthy_for(waiter.model):
                free[waiter.model] = slots - 1
                woken.append(waiter)
        for waiter in woken:
            self.waiters.remove(waiter)
            waiter.ready.set_result(None)
        heapq.heapify(self.waiters)
        self.metrics.queue_depth.set(len(self.waiters))


_MAX_BUCKETS = 10_000


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket of requests per API key (the Authorization header; clients without
    one share a bucket): `rate` requests a second on average, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.buckets: dict[str, _Bucket] = {}

    def check(self, key: str) -> None:
        now = time.monotonic()
        if len(self.buckets) > _MAX_BUCKETS:  # forget keys whose buckets have refilled
            self.buckets = {k: b for k, b in self.buckets.items()
                            if b.tokens + (now - b.updated) * self.rate < self.burst}
        bucket = self.buckets.setdefault(key, _Bucket(self.burst, now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens < 1:
            retry_after = math.ceil((1 - bucket.tokens) / self.rate)
            raise RouterError(429, f"rate limit of {self.rate:g} requests/s exceeded for this API key",
                              type="rate_limit_error", code="rate_limit_exceeded",
                              headers={"Retry-After": str(retry_after)})
        bucket.tokens -= 1
