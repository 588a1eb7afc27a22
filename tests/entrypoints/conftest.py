"""Fixtures: the shared real server, the offline reference engine, and a tiny model."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random one-layer Llama with a word-level tokenizer, for tests of what the server does
    around a model (health, gauges, shutdown, its processes) rather than of SmolLM2's tokens: its
    steps take milliseconds where SmolLM2's take a quarter of a second on one thread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import randomize, save_tokenizer

    directory = os.path.join(tmp_path_factory.mktemp("tiny"), "tiny")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=4096))
    randomize(model, 0)
    model.save_pretrained(directory)
    save_tokenizer(directory, 64)
    return directory
