"""`kvserve router` flags."""

from __future__ import annotations

import argparse

from kvserve.router.policies import POLICIES, CacheAwareSettings

_CACHE_AWARE = CacheAwareSettings()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    workers = parser.add_argument_group("workers")
    workers.add_argument("--worker", action="append", metavar="URL",
                         help="A kvserve serve (or other OpenAI) server, e.g. http://10.0.0.1:8000; "
                              "repeatable. Its models are read from its /v1/models.")
    workers.add_argument("--config", default=None, metavar="ROUTER_YAML",
                         help="YAML file mapping model names to worker URLs (docs/router.md).")
    workers.add_argument("--launch", type=int, default=0, metavar="N",
                         help="Start N local `kvserve serve` replicas with the arguments after `--` "
                              "(one GPU each when there are GPUs) and route to them.")
    workers.add_argument("--launch-base-port", type=int, default=None,
                         help="First port of the launched replicas (default: free ports).")
    workers.add_argument("--worker-api-key", default=None,
                         help="Key the health checks send to workers' /v1/models; client "
                              "requests carry their own Authorization header through.")
    routing = parser.add_argument_group("routing")
    routing.add_argument("--policy", choices=POLICIES, default="cache_aware",
                         help="cache_aware: keep shared prefixes on one worker unless load is "
                              "imbalanced; round_robin; least_outstanding: fewest requests in flight.")
    routing.add_argument("--cache-threshold", type=float, default=_CACHE_AWARE.cache_threshold,
                         help="cache_aware: smallest fraction of the prompt a worker's history "
                              "must match for the request to follow it.")
    routing.add_argument("--balance-abs-threshold", type=int, default=_CACHE_AWARE.balance_abs_threshold,
                         help="cache_aware: load is imbalanced when the most and least loaded "
                              "workers differ by more than this many requests in flight...")
    routing.add_argument("--balance-rel-threshold", type=float, default=_CACHE_AWARE.balance_rel_threshold,
                         help="...and the most loaded has more than this times the least's.")
    routing.add_argument("--max-tree-size", type=int, default=_CACHE_AWARE.max_tree_size,
                         help="cache_aware: characters (or token ids) of routing history kept per "
                              "worker; the least recently used go first.")
    routing.add_argument("--max-attempts", type=int, default=3,
                         help="Workers tried for one request that fails before its first byte.")
    routing.add_argument("--connect-timeout", type=float, default=5.0,
                         help="Seconds to connect to a worker before trying another.")
    admission = parser.add_argument_group("admission")
    admission.add_argument("--max-outstanding-per-worker", type=int, default=None,
                           help="Requests in flight that saturate a worker; when every worker of "
                                "a model is saturated, requests queue in the router by priority "
                                "(default: no limit, the workers queue)")
    admission.add_argument("--max-queue-size", type=int, default=1024,
                           help="Requests the router's queue holds; beyond it, 429 with Retry-After.")
    admission.add_argument("--rate-limit", type=float, default=None, metavar="REQUESTS_PER_S",
                           help="Requests a second allowed per API key (token bucket); beyond it, "
                                "429 with Retry-After (default: no limit)")
    admission.add_argument("--rate-limit-burst", type=int, default=10,
                           help="Requests one API key may send at once within --rate-limit.")
    admission.add_argument("--token-rate-limit", type=float, default=None, metavar="TOKENS_PER_S",
                           help="Tokens a second allowed per API key (token bucket): a request counts "
                                "its prompt (~4 characters a token; token ids one each) plus the most "
                                "output tokens it asks for (max_tokens x n); beyond it, 429 with "
                                "Retry-After (default: no limit)")
    admission.add_argument("--token-rate-limit-burst", type=int, default=None,
                           help="Tokens one API key may send at once within --token-rate-limit "
                                "(default: one minute's worth); a larger request is refused.")
    health = parser.add_argument_group("health checks")
    health.add_argument("--health-check-interval", type=float, default=5.0,
                        help="Seconds between GET /health checks of a worker.")
    health.add_argument("--health-check-timeout", type=float, default=5.0,
                        help="Seconds a health check may take.")
    health.add_argument("--health-failure-threshold", type=int, default=2,
                        help="Failed checks in a row that take a worker out.")
    health.add_argument("--health-success-threshold", type=int, default=1,
                        help="Good checks in a row that take a worker back.")
    health.add_argument("--health-max-backoff", type=float, default=60.0,
                        help="Longest wait between checks of a worker that is out (the wait "
                             "doubles after each failure).")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="On SIGTERM, seconds in-flight requests may take to finish.")
