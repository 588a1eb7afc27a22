"""Shared fixtures: the real embedded SmolLM2 model and its transformers reference."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep torch from oversubscribing them alongside pytest.
torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvserve.model_executor.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own load of the same GGUF file, dequantized to fp32."""
    from kvserve.benchmarks.hf_reference import load_hf_model

    return load_hf_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_path):
    """kvserve's fp32 load of the embedded GGUF; engines in tests share these weights."""
    from kvserve.model_executor.loader import load_model

    return load_model(smollm2_path, dtype=torch.float32)


@pytest.fixture
def smollm2_llm(smollm2_loaded):
    """A fresh engine (own KV cache and scheduler) on the shared weights."""
    from kvserve import LLM

    return LLM(loaded=smollm2_loaded, kv_cache_memory="256MiB")
