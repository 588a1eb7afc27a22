"""kvserve: an LLM inference and serving engine."""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# libgomp (torch's CPU thread pool) lets its workers spin only ~100 iterations between
# parallel regions once it manages more threads than there are cores, which is the case as
# soon as a thread other than the main one (the engine's worker thread) runs torch on a
# 2-core machine; each of a CPU step's ~1,000 regions then pays a sleep and a wake-up.
# A million spins (~25 ms of one core after the last region, then sleep) keeps the workers
# awake across a step: SmolLM2 batch-1 decode in a worker thread 31-39 -> 22-24 ms, and
# served 1-stream ITL p50 32.6 -> 26.0 ms (BENCHMARKS.md). Read when libgomp loads, so it
# only applies if torch is imported after kvserve; an explicit setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000000")

# Resolved on first use, so importing a submodule does not load the whole engine.
_EXPORTS = {
    "LLM": "kvserve.llm",
    "SamplingParams": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
