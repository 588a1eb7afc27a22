"""The router's view of each worker: health, the models it serves, requests in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.router.config import WorkerSpec


@dataclass
class Worker:
    url: str
    configured_models: frozenset[str] | None
    models: frozenset[str] = frozenset()
    healthy: bool = False
    # False until the first health check: its answer decides at once, thresholds after.
    checked: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    next_check_at: float = 0.0
    last_error: str | None = None
    outstanding: int = 0
    # LoRA adapters the worker serves (models of /v1/models with a parent), and those with
    # requests running on it as of the last health check (resident in its adapter slots).
    adapters: frozenset[str] = frozenset()
    running_adapters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.configured_models is not None:
            self.models = self.configured_models


@dataclass
class WorkerPool:
    workers: list[Worker] = field(default_factory=list)

    @classmethod
    def from_specs(cls, specs: list[WorkerSpec]) -> "WorkerPool":
        return cls([Worker(spec.url, spec.models) for spec in specs])

    def models(self) -> list[str]:
        """Every model some worker serves or is configured to serve, sorted."""
        return sorted({model for worker in self.workers for model in worker.models})

    def healthy_for(self, model: str) -> list[Worker]:
        return [w for w in self.workers if w.healthy and model in w.models]

    def mark_down(self, worker: Worker, reason: str, retry_in_s: float) -> None:
        """Take a worker out after a failure the router saw itself (its connection refused):
        the health checks take it back once it answers again."""
        worker.healthy = False
        worker.consecutive_successes = 0
        worker.last_error = reason
        worker.next_check_at = time.monotonic() + retry_in_s
