"""kvserve: an LLM inference and serving engine."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

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
