"""The router's own Prometheus metrics (its /metrics; each worker keeps its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PREFIX = "kvserve_router:"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(_PREFIX + "requests", "Requests sent to a worker (retries included).",
                                ["worker", "model"], registry=r)
        self.errors = Counter(_PREFIX + "request_errors",
                              "Requests that failed at a worker: no answer, or cut mid-stream.",
                              ["worker", "kind"], registry=r)
        self.retries = Counter(_PREFIX + "retries",
                               "Requests retried on another worker after this one failed before answering.",
                               ["worker"], registry=r)
        self.outstanding = Gauge(_PREFIX + "outstanding_requests", "Requests in flight at a worker.",
                                 ["worker"], registry=r)
        self.worker_healthy = Gauge(_PREFIX + "worker_healthy", "1 when the worker is in rotation.",
                                    ["worker"], registry=r)
        self.routing_decisions = Counter(_PREFIX + "routing_decisions",
                                         "Routing decisions by policy and branch.",
                                         ["policy", "branch"], registry=r)
        self.prefix_match_length = Histogram(
            _PREFIX + "prefix_match_length",
            "Longest prefix (characters or token ids) of a prompt found in a worker's routing history.",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
        self.queue_depth = Gauge(_PREFIX + "queue_depth", "Requests waiting for a worker with room.",
                                 registry=r)
        self.queue_time = Histogram(_PREFIX + "queue_time_seconds",
                                    "Time a request waited in the router's queue for a worker with room.",
                                    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
                                    registry=r)
        self.rejected = Counter(_PREFIX + "rejected_requests",
                                "Requests answered by the router itself with an error.",
                                ["reason"], registry=r)
