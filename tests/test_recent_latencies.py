"""The dashboard's latency windows, on a clock the test sets: what a request's outputs show
while a dashboard watches, nothing while none does, and the charts' summary of a window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve import metrics
from kvserve.entrypoints.openai.dashboard import latency_summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _output(num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(num_tokens)))])


def _run_request(server_metrics: metrics.ServerMetrics, clock: Clock, token_times: list[tuple[float, int]]) -> None:
    """A request arriving now whose outputs come at (seconds later, tokens so far)."""
    start = clock.now
    tracker = server_metrics.track(num_prompt_tokens=5)
    for at, num_tokens in token_times:
        clock.now = start + at
        tracker.on_output(_output(num_tokens))


def test_windows_hold_what_outputs_showed_only_while_watched(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    server_metrics = metrics.ServerMetrics("m")
    recent = server_metrics.recent

    _run_request(server_metrics, clock, [(0.5, 1), (0.7, 2)])  # nobody watching
    first = recent.take()  # starts the watch: an empty window
    assert (first.seconds, first.output_tokens, first.time_to_first_token) == (0.0, 0, [])

    clock.now += 1.0
    _run_request(server_metrics, clock, [(0.5, 1), (0.7, 2), (1.0, 4)])
    clock.now += 0.5
    window = recent.take()
    assert window.seconds == pytest.approx(2.5)
    assert window.output_tokens == 4
    assert window.time_to_first_token == pytest.approx([0.5])
    assert window.inter_token_latency == pytest.approx([0.2, 0.3])
    assert latency_summary(window) == {
        "window_s": pytest.approx(2.5), "output_tokens": 4, "output_tokens_per_s": pytest.approx(4 / 2.5),
        "ttft": {"count": 1, "mean": pytest.approx(0.5), "max": pytest.approx(0.5)},
        "itl": {"count": 2, "mean": pytest.approx(0.25), "max": pytest.approx(0.3)},
    }

    # A dashboard that stops asking stops the recording once its watch runs out.
    clock.now += metrics.RecentLatencies.WATCH_S + 1
    _run_request(server_metrics, clock, [(0.5, 1), (0.7, 2)])
    late = recent.take()
    assert (late.seconds, late.output_tokens, late.inter_token_latency) == (0.0, 0, [])
