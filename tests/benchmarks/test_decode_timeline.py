"""The decode-timeline analysis (kvserve/benchmarks/decode_timeline.py) on a hand-built
Chrome trace whose answers are counted by hand: three graph launches, PDL kernels that start
before the one ahead of them ends, and work outside the graphs between them."""

from __future__ import annotations

import pytest

from kvserve.benchmarks.decode_timeline import chain_costs, idle_report, step_timeline


def _launch(ts: float, correlation: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 30.0,
            "args": {"correlation": correlation}}


def _work(name: str, ts: float, dur: float, correlation: int, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _graph(start: float, correlation: int) -> list[dict]:
    """One step of a 2-layer model: per layer gemv (qkv), attn, gemv (o); the PDL kernels start
    early. Ends, from start: 10, 14, 20, 30, 34, 40."""
    kernels = []
    for layer in range(2):
        base = start + 20 * layer
        kernels += [_work("gemv", base, 10, correlation), _work("attn", base + 5, 9, correlation),
                    _work("gemv", base + 12, 8, correlation)]
    return kernels


@pytest.fixture
def events() -> list[dict]:
    trace = [_launch(0, 1), _launch(100, 2), _launch(200, 3)]
    trace += _graph(10, 1) + _graph(110, 2) + _graph(210, 3)
    # Between the graphs: the argmax, then an input copy after an idle gap.
    for step, at in ((1, 52), (2, 152)):
        trace += [_work("argmax", at, 2, 50 + step), _work("Memcpy HtoD", at + 6, 1, 60 + step, "gpu_memcpy")]
    trace += [{"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 120, "dur": 4.0, "args": {}},
              {"cat": "cpu_op", "name": "aten::copy_", "ts": 119, "dur": 1.0}]  # under 2 us: not listed
    return trace


def test_idle_report_counts_busy_time_once_and_names_the_gaps(events) -> None:
    report = idle_report(events, skip=0)
    assert report is not None and report.steps == 2 and report.span_us == 200
    # Per step: the graph's union 10 -> 50 (40 us), argmax 2, copy 1: 43 busy of 100.
    assert report.busy_us == pytest.approx(2 * 43)
    assert report.outside_graphs == {"argmax": [2, 4.0], "Memcpy HtoD": [2, 2.0]}
    # Gaps: launch -> first gemv (10), gemv -> argmax (2), argmax -> copy (4), copy -> next gemv
    # (51); the last copy's next gemv is past the last launch, where the window ends (41 idle).
    assert report.gaps == {("(launch)", "gemv"): [1, 10.0], ("gemv", "argmax"): [2, 4.0],
                           ("argmax", "Memcpy HtoD"): [2, 8.0], ("Memcpy HtoD", "gemv"): [1, 51.0]}
    assert sum(us for _, us in report.gaps.values()) + 41 == pytest.approx(report.span_us - report.busy_us)
    assert report.host_calls == {"cudaGraphLaunch": [2, 60.0], "cudaMemcpyAsync": [1, 4.0]}


def test_idle_report_needs_two_launches_past_the_skipped(events) -> None:
    assert idle_report(events, skip=2) is None


def test_chain_costs_charge_each_kernel_its_end_after_the_work_before(events) -> None:
    steps, costs = chain_costs(events, skip=1, layers=2)
    assert steps == 2
    # Each layer: qkv ends 10 after the step (or layer) began, attn 4 later, o 6 later.
    assert costs == {"gemv#0": [10.0, 10.0, 10.0, 10.0], "attn": [4.0, 4.0, 4.0, 4.0],
                     "gemv#1": [6.0, 6.0, 6.0, 6.0]}
    assert sum(sum(values) for values in costs.values()) / steps == 40.0  # the graph's span


def test_step_timeline_lists_host_calls_and_outside_work_in_order(events) -> None:
    rows = step_timeline(events, skip=1, count=1)
    assert [(offset, side, what) for offset, _, side, what in rows] == [
        (-100.0, "host", "cuda_runtime: cudaGraphLaunch"),
        (-90.0, "GPU", "graph (6 activities)"),
        (-48.0, "GPU", "argmax"),
        (-42.0, "GPU", "Memcpy HtoD"),
        (0.0, "host", "cuda_runtime: cudaGraphLaunch"),
        (10.0, "GPU", "graph (6 activities)"),
        (20.0, "host", "cuda_runtime: cudaMemcpyAsync"),
        (52.0, "GPU", "argmax"),
        (58.0, "GPU", "Memcpy HtoD"),
    ]
