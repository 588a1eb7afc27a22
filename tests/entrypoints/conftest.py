"""Fixtures: the shared real server and the offline reference engine."""

from __future__ import annotations

import pytest
from server_process import launch_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The shared server most tests talk to (max_model_len 1024 keeps the overflow case cheap)."""
    proc = launch_server(tmp_path_factory.mktemp("server"), "--max-model-len", "1024",
                         "--tool-call-parser", "hermes")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def reference_llm(smollm2_loaded):
    """The offline engine on the same weights: the independent reference for outputs."""
    from kvserve import LLM

    return LLM(loaded=smollm2_loaded, kv_cache_memory="256MiB", max_model_len=1024)

