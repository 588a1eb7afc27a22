"""Timing a captured CUDA graph: the median of several replays, each after one warm replay,
per call the graph holds. The kernel sweeps and the quantized-linear benchmark time their
calls this way: one replay launches them all, so launch overhead stays out of the number."""

from __future__ import annotations

import statistics

import torch


def replay_us(graph: torch.cuda.CUDAGraph, calls_per_replay: int, rounds: int = 5) -> float:
    """Microseconds per call: the median over `rounds` timed replays of `graph`, which holds
    `calls_per_replay` calls, after one untimed replay."""
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_replay)
    return statistics.median(times)
