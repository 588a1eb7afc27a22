"""CUDA-graph capture for the GPU tests."""

from __future__ import annotations

from typing import Callable

import torch


def captured(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """step() run once on a side stream (Triton compiles, the allocator warms up), then
    captured: the graph and the output tensor its replays write."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
