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
    """A token bucket per API key (the Authorization header; clients without one share a
    bucket): `rate` units a second on average, bursts of up to `burst`; a unit is a request,
    or (`unit="tokens"`) a token of the request's estimated size (request_tokens)."""

    def __init__(self, rate: float, burst: int, unit: str = "requests") -> None:
        self.rate = rate
        self.burst = burst
        self.unit = unit
        self.buckets: dict[str, _Bucket] = {}

    def check(self, key: str, cost: float = 1) -> None:
        """Take `cost` units from the key's bucket, or raise 429 with when to retry."""
        if cost > self.burst:
            raise RouterError(429, f"this request counts {cost:g} {self.unit}, more than the {self.burst} "
                              f"{self.unit} an API key may send at once", type="rate_limit_error",
                              code="rate_limit_exceeded")
        now = time.monotonic()
        if len(self.buckets) > _MAX_BUCKETS:  # forget keys whose buckets have refilled
            self.buckets = {k: b for k, b in self.buckets.items()
                            if b.tokens + (now - b.updated) * self.rate < self.burst}
        bucket = self.buckets.setdefault(key, _Bucket(self.burst, now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens < cost:
            retry_after = math.ceil((cost - bucket.tokens) / self.rate)
            raise RouterError(429, f"rate limit of {self.rate:g} {self.unit}/s exceeded for this API key",
                              type="rate_limit_error", code="rate_limit_exceeded",
                              headers={"Retry-After": str(retry_after)})
        bucket.tokens -= cost


# Characters per token for the token rate limit's estimate of a prompt's size (the router
# does not tokenize).
CHARS_PER_TOKEN = 4


def request_tokens(body: dict) -> int:
    """What a request counts against a token rate limit: its prompt (text at CHARS_PER_TOKEN,
    token ids one each) plus the output tokens it asks for at most, for each of its `n`
    samples and prompts."""
    prompt = body.get("prompt", "")
    if "messages" in body:
        prompts = [str(m.get("content") or "") if isinstance(m, dict) else "" for m in body.get("messages") or []]
        prompt_tokens = sum(-(-len(p) // CHARS_PER_TOKEN) for p in prompts)
        num_prompts = 1
    else:
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        prompt_tokens = sum(len(p) if isinstance(p, list) else -(-len(str(p)) // CHARS_PER_TOKEN) for p in prompts)
        num_prompts = len(prompts)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or 0
    samples = body.get("n") or 1
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (max_tokens, samples)):
        raise RouterError(400, "max_tokens and n must be non-negative integers", param="max_tokens")
    return prompt_tokens + num_prompts * samples * max_tokens
