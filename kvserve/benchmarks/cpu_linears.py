"""Shared by the CPU linear-kernel comparisons (benchmarks/cpu_int*_linears.py): SmolLM2's
decode-step linears and a wall-clock timer over a step's calls."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# (out, in) of SmolLM2's fused linears: qkv, o, gate_up, down; a step runs each in 30 layers.
SMOLLM2_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SMOLLM2_LAYERS = 30


def step_ms(calls: list[Callable[[], torch.Tensor]], rounds: int = 10) -> float:
    """Mean ms of running every call once, after one warm-up pass."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(rounds):
        for call in calls:
            call()
    return (time.perf_counter() - start) / rounds * 1e3
