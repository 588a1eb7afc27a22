"""Prometheus metrics of the server, all defined here.

Names mirror vLLM's with the `kvserve:` prefix so dashboards port by a rename. Each server
owns a CollectorRegistry (not the global one), so several servers or tests never collide.
Request latencies are observed by the server as outputs arrive; engine state (queues,
KV usage, preemptions, prefix-cache and speculative-decoding totals) is the engine's
SchedulerStats, read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.kv_report import kv_cache_report

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.outputs import RequestOutput

_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets).labels(model_name)

        self.time_to_first_token = histogram(
            "kvserve:time_to_first_token_seconds",
            "Time from the server receiving a request to its first generated token.",
            _TOKEN_LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between successive token outputs of a request.", _TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "kvserve:time_per_output_token_seconds",
            "Per request: (end-to-end - time to first token) / (output tokens - 1).",
            _TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "kvserve:e2e_request_latency_seconds",
            "Time from the server receiving a request to its last token.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "kvserve:request_queue_time_seconds",
            "Time a request waited in the engine before it was first scheduled.",
            _REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Counter(
            "kvserve:prompt_tokens", "Prompt tokens of finished or aborted requests.", labels,
            registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(
            "kvserve:generation_tokens", "Generated tokens (all samples of a request).", labels,
            registry=self.registry).labels(model_name)
        self.prompt_images = Counter(
            "kvserve:prompt_images", "Images in the prompts of finished or aborted requests.", labels,
            registry=self.registry).labels(model_name)
        # One count per sample (choice), labelled stop / length / abort.
        self.request_success = Counter(
            "kvserve:request_success", "Finished samples by finish reason.",
            [*labels, "finished_reason"], registry=self.registry)
        self.recent = RecentLatencies()  # the live dashboard's charts

    def attach_engine(self, engine: LLMEngine) -> None:
        self.registry.register(_EngineCollector(engine, self.model_name))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int, num_images: int = 0) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens, num_images)


@dataclass
class LatencyWindow:
    """Latencies and output tokens seen in one window of the live dashboard."""

    seconds: float
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    output_tokens: int = 0


class RecentLatencies:
    """What requests' outputs showed since the dashboard last looked: recorded only while it
    watches (`take` renews the watch for WATCH_S), so no dashboard costs nothing and an
    abandoned one cannot grow it without bound."""

    WATCH_S = 5.0

    def __init__(self) -> None:
        self._window = LatencyWindow(0.0)
        self._since = time.perf_counter()
        self._watched_until = 0.0

    @property
    def watched(self) -> bool:
        return time.perf_counter() < self._watched_until

    def observe(self, num_new_tokens: int, first_token_latency: float | None, token_gap: float | None) -> None:
        window = self._window
        window.output_tokens += num_new_tokens
        if first_token_latency is not None:
            window.time_to_first_token.append(first_token_latency)
        if token_gap is not None:
            window.inter_token_latency.append(token_gap)

    def take(self) -> LatencyWindow:
        """The window since the last take (or since the watch began)."""
        now = time.perf_counter()
        if not self.watched:
            self._window, self._since = LatencyWindow(0.0), now
        window, window.seconds = self._window, now - self._since
        self._window, self._since, self._watched_until = LatencyWindow(0.0), now, now + self.WATCH_S
        return window


class RequestTracker:
    """Latency bookkeeping of one engine request; observed once when it ends."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, num_images: int = 0) -> None:
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._num_images = num_images
        self._arrival = time.perf_counter()
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._num_tokens = 0
        self._last_output: RequestOutput | None = None

    def on_output(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens > self._num_tokens:
            first_token_latency = token_gap = None
            if self._first_token is None:
                self._first_token = now
                first_token_latency = now - self._arrival
            else:
                token_gap = now - self._last_token
                self._metrics.inter_token_latency.observe(token_gap)
            recent = self._metrics.recent
            if recent.watched:
                recent.observe(num_tokens - self._num_tokens, first_token_latency, token_gap)
            self._last_token = now
            self._num_tokens = num_tokens
        self._last_output = output

    def finish(self) -> None:
        """Call once, whether the request finished or was aborted (client gone, shutdown)."""
        metrics, output = self._metrics, self._last_output
        metrics.prompt_tokens.inc(self._num_prompt_tokens)
        metrics.prompt_images.inc(self._num_images)
        if output is None:
            metrics.request_success.labels(metrics.model_name, "abort").inc()
            return
        metrics.generation_tokens.inc(self._num_tokens)
        for completion in output.outputs:
            reason = completion.finish_reason if output.finished else "abort"
            metrics.request_success.labels(metrics.model_name, reason or "abort").inc()
        if not output.finished or self._first_token is None:
            return
        ttft = self._first_token - self._arrival
        e2e = self._last_token - self._arrival
        metrics.time_to_first_token.observe(ttft)
        metrics.e2e_request_latency.observe(e2e)
        longest = max(len(c.token_ids) for c in output.outputs)
        if longest > 1:
            metrics.time_per_output_token.observe((e2e - ttft) / (longest - 1))
        times = output.metrics
        if times.first_scheduled_time is not None:
            metrics.request_queue_time.observe(times.first_scheduled_time - times.arrival_time)


class _EngineCollector(Collector):
    """Engine state read at scrape time (plain reads of counters the worker thread updates)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def _family(self, kind: type, name: str, doc: str, value: float) -> Metric:
        family = kind(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def _lora_families(self, lora_requests: dict[str, tuple[int, int]]) -> Iterator[Metric]:
        """Per-adapter request counts, and vLLM's lora_requests_info (its labels list the
        adapters with running and with waiting requests), for engines serving LoRA."""
        lora_config = self._engine.client.info.lora_config
        if lora_config is None:
            return
        running = GaugeMetricFamily("kvserve:lora_num_requests_running", "Requests running on each LoRA adapter.",
                                    labels=["model_name", "lora_name"])
        waiting = GaugeMetricFamily("kvserve:lora_num_requests_waiting", "Requests waiting, per LoRA adapter.",
                                    labels=["model_name", "lora_name"])
        for name, (num_running, num_waiting) in sorted(lora_requests.items()):
            running.add_metric([*self._labels, name], num_running)
            waiting.add_metric([*self._labels, name], num_waiting)
        info = GaugeMetricFamily("kvserve:lora_requests_info", "Running and waiting LoRA adapters (labels); the "
                                 "value is when it was read.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(lora_config.max_loras),
                         ",".join(sorted(n for n, (r, _) in lora_requests.items() if r)),
                         ",".join(sorted(n for n, (_, w) in lora_requests.items() if w))], time.time())
        yield from (running, waiting, info)

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        yield self._family(GaugeMetricFamily, "kvserve:num_requests_running",
                           "Requests with a sample running in the engine (one per prompt).",
                           stats.num_running_reqs)
        yield self._family(GaugeMetricFamily, "kvserve:num_requests_waiting",
                           "Requests waiting to be scheduled (none of their samples running).",
                           stats.num_waiting_reqs)
        yield self._family(GaugeMetricFamily, "kvserve:num_sequences_running",
                           "Sequences running in the engine: each of a request's n samples.",
                           stats.num_running_seqs)
        yield self._family(GaugeMetricFamily, "kvserve:num_sequences_waiting",
                           "Sequences waiting to be scheduled.", stats.num_waiting_seqs)
        yield self._family(GaugeMetricFamily, "kvserve:kv_cache_usage_perc",
                           "Fraction of KV-cache blocks in use (0..1).", stats.kv_cache_usage)
        blocks = GaugeMetricFamily("kvserve:kv_cache_blocks",
                                   "KV-cache blocks by state: used (held by a sequence), cached (free, "
                                   "revivable by a prefix hit), free.", labels=["model_name", "state"])
        report = kv_cache_report(stats, self._engine.client.info)
        for state in ("used", "cached", "free"):
            blocks.add_metric([*self._labels, state], report["blocks"][state])
        yield blocks
        yield self._family(GaugeMetricFamily, "kvserve:kv_cache_shared_blocks",
                           "Used KV blocks held by more than one sequence (prefix sharing, forks).",
                           report["sharing"]["shared_blocks"])
        yield self._family(GaugeMetricFamily, "kvserve:kv_cache_sharing_saved_bytes",
                           "KV bytes that sharing blocks saves: references beyond one per block.",
                           report["sharing"]["bytes_saved"])
        yield self._family(GaugeMetricFamily, "kvserve:kv_cache_internal_fragmentation",
                           "Fraction of the used blocks' token slots that hold no token (0..1).",
                           report["fragmentation"]["internal"])
        yield self._family(GaugeMetricFamily, "kvserve:decode_graphs_pending",
                           "CPU decode graphs still to compile; `kvserve serve` compiles them while idle, "
                           "and steps of their batch sizes run eager until then.", stats.decode_graphs_pending)
        yield self._family(CounterMetricFamily, "kvserve:num_preemptions",
                           "Sequences preempted for lack of KV blocks.", stats.num_preemptions)
        yield self._family(CounterMetricFamily, "kvserve:prefix_cache_queries",
                           "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
        yield self._family(CounterMetricFamily, "kvserve:prefix_cache_hits",
                           "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield self._family(CounterMetricFamily, "kvserve:encoder_images",
                           "Images run through the vision encoder (an image cached per hash is not "
                           "encoded again).", stats.num_images_encoded)
        yield self._family(CounterMetricFamily, "kvserve:encoder_time_seconds",
                           "Seconds the vision encoder ran.", stats.encoder_seconds)
        yield from self._lora_families(stats.lora_requests)
        spec = stats.spec_decode
        if spec is None:
            return
        yield self._family(CounterMetricFamily, "kvserve:spec_decode_num_drafts",
                           "Speculative verify runs (one per sequence per step with drafts).",
                           spec.num_drafts)
        yield self._family(CounterMetricFamily, "kvserve:spec_decode_num_draft_tokens",
                           "Draft tokens proposed for verification.", spec.num_draft_tokens)
        yield self._family(CounterMetricFamily, "kvserve:spec_decode_num_accepted_tokens",
                           "Draft tokens the target accepted.", spec.num_accepted_tokens)
        per_position = CounterMetricFamily(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0 = first).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([*self._labels, str(position)], count)
        yield per_position
