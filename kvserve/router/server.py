"""Building the router from its flags and running it on uvicorn."""

from __future__ import annotations

import argparse
import logging
import math
import signal

import httpx
import uvicorn

from kvserve.router.admission import AdmissionQueue, RateLimiter
from kvserve.router.app import RouterState, build_app
from kvserve.router.config import WorkerSpec, load_config, specs_from_urls
from kvserve.router.health import HealthChecker, HealthSettings
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import CacheAwareSettings, make_policy
from kvserve.router.proxy import Forwarder
from kvserve.router.workers import WorkerPool

logger = logging.getLogger(__name__)


def worker_specs(args: argparse.Namespace, launched_urls: list[str]) -> list[WorkerSpec]:
    specs = specs_from_urls((args.worker or []) + launched_urls)
    if args.config:
        configured = load_config(args.config)
        known = {spec.url for spec in configured}
        specs = configured + [spec for spec in specs if spec.url not in known]
    if not specs:
        raise ValueError("no workers: pass --worker URL, --config router.yaml or --launch N")
    return specs


def build_state(args: argparse.Namespace, specs: list[WorkerSpec]) -> RouterState:
    metrics = RouterMetrics()
    pool = WorkerPool.from_specs(specs)
    admission = AdmissionQueue(pool, args.max_outstanding_per_worker, args.max_queue_size, metrics)
    rate_limiter = RateLimiter(args.rate_limit, args.rate_limit_burst) if args.rate_limit else None
    token_burst = args.token_rate_limit_burst or math.ceil(60 * (args.token_rate_limit or 0))
    token_rate_limiter = (RateLimiter(args.token_rate_limit, token_burst, unit="tokens")
                          if args.token_rate_limit else None)
    # No read timeout: a long generation may be silent for minutes before its first token.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=args.connect_timeout),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
    health = HealthChecker(pool, client, HealthSettings(
        interval_s=args.health_check_interval, timeout_s=args.health_check_timeout,
        failure_threshold=args.health_failure_threshold,
        success_threshold=args.health_success_threshold,
        max_backoff_s=args.health_max_backoff), metrics, args.worker_api_key, admission.wake)
    policy = make_policy(args.policy, CacheAwareSettings(
        cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold, max_tree_size=args.max_tree_size), metrics)
    forwarder = Forwarder(pool, policy, client, metrics, max_attempts=args.max_attempts,
                          retry_down_s=args.health_check_interval, has_room=admission.has_room)
    return RouterState(pool, metrics, client, health, forwarder, admission, rate_limiter, token_rate_limiter)


class _DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop listening, answer 503 on open connections, let the requests in
    flight finish (uvicorn waits up to --shutdown-timeout), exit 0. A second signal stops at
    once."""

    def __init__(self, config: uvicorn.Config, state: RouterState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's own handler this does not re-raise the signal after shutdown,
        # so a drained router exits 0.
        if self.state.draining:
            self.force_exit = True
        else:
            logger.info("received %s: draining %d requests in flight", signal.Signals(sig).name,
                        sum(w.outstanding for w in self.state.pool.workers))
            self.state.draining = True
        self.should_exit = True


def serve(args: argparse.Namespace, specs: list[WorkerSpec]) -> int:
    # httpx logs every request at INFO: one line per proxied request and health check.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state = build_state(args, specs)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.shutdown_timeout)
    logger.info("kvserve router on http://%s:%d, policy %s, workers: %s", args.host, args.port,
                args.policy, ", ".join(spec.url for spec in specs))
    _DrainingServer(config, state).run()
    return 0
