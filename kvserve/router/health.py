"""Active health checks: GET /health (and /v1/models for workers whose models are learnt).

A healthy worker is taken out after `failure_threshold` failed checks in a row, an unhealthy
one taken back after `success_threshold` good ones; an unhealthy worker is checked with
exponential backoff so that a dead machine costs little.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import RouterMetrics
from kvserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 5.0
    timeout_s: float = 5.0
    failure_threshold: int = 2
    success_threshold: int = 1
    max_backoff_s: float = 60.0


class HealthChecker:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient, settings: HealthSettings,
                 metrics: RouterMetrics, worker_api_key: str | None,
                 after_round: Callable[[], None]) -> None:
        self.pool = pool
        self.after_round = after_round
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}

    async def probe(self, worker: Worker) -> frozenset[str]:
        """The models the worker serves; raises with the reason it is not usable."""
        health = await self.client.get(f"{worker.url}/health", timeout=self.settings.timeout_s)
        if health.status_code != 200:
            raise RuntimeError(f"/health answered {health.status_code}")
        response = await self.client.get(f"{worker.url}/v1/models", headers=self.headers,
                                         timeout=self.settings.timeout_s)
        try:
            entries = response.json()["data"]
            models = frozenset(entry["id"] for entry in entries)
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"/v1/models answered {response.status_code} without an OpenAI "
                               "model list: not a kvserve/OpenAI server?") from None
        worker.adapters = frozenset(e["id"] for e in entries if isinstance(e, dict) and e.get("parent"))
        worker.running_adapters = await self.running_adapters(worker) if worker.adapters else frozenset()
        if worker.configured_models is not None:
            missing = worker.configured_models - models
            if missing:
                raise RuntimeError(f"does not serve {', '.join(sorted(missing))} (it serves "
                                   f"{', '.join(sorted(models)) or 'nothing'})")
            return worker.configured_models
        return models

    async def running_adapters(self, worker: Worker) -> frozenset[str]:
        """The adapters with requests running on the worker, from the running_lora_adapters
        label of its lora_requests_info metric (vLLM's; none where it has no such metric)."""
        response = await self.client.get(f"{worker.url}/metrics", timeout=self.settings.timeout_s)
        if response.status_code != 200:
            return frozenset()
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name.endswith("lora_requests_info"):
                    return frozenset(filter(None, sample.labels.get("running_lora_adapters", "").split(",")))
        return frozenset()

    async def check(self, worker: Worker) -> None:
        settings = self.settings
        try:
            models = await self.probe(worker)
        except (httpx.HTTPError, RuntimeError) as error:
            reason = str(error) or type(error).__name__
            worker.consecutive_successes = 0
            worker.consecutive_failures += 1
            if worker.healthy and (worker.consecutive_failures >= settings.failure_threshold
                                   or not worker.checked):
                logger.warning("worker %s taken out: %s", worker.url, reason)
                worker.healthy = False
            elif not worker.checked or reason != worker.last_error:
                logger.warning("worker %s unhealthy: %s", worker.url, reason)
            worker.last_error = reason
            if not worker.healthy:
                backoff = settings.interval_s * 2 ** max(0, worker.consecutive_failures - 1)
                worker.next_check_at = time.monotonic() + min(backoff, settings.max_backoff_s)
            else:
                worker.next_check_at = time.monotonic() + settings.interval_s
        else:
            worker.models = models
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            if not worker.healthy and (worker.consecutive_successes >= settings.success_threshold
                                       or not worker.checked):
                logger.info("worker %s healthy, serving %s", worker.url, ", ".join(sorted(models)))
                worker.healthy = True
                worker.last_error = None
            worker.next_check_at = time.monotonic() + settings.interval_s
        worker.checked = True
        self.metrics.worker_healthy.labels(worker.url).set(1 if worker.healthy else 0)

    async def check_due(self) -> None:
        now = time.monotonic()
        due = [w for w in self.pool.workers if w.next_check_at <= now]
        await asyncio.gather(*(self.check(worker) for worker in due))
        self.after_round()

    async def run(self) -> None:
        while True:
            await self.check_due()
            # Wake often enough that a taken-out worker's short retry is not overslept.
            await asyncio.sleep(min(0.5, self.settings.interval_s))
