"""`kvserve serve` compiles its CPU decode graphs in a background thread: requests that come
meanwhile run eager steps at once instead of waiting, and a fresh server answers its first
chat request within 2 s of reporting healthy."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from transformers import MistralConfig, MistralForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model_executor.compiled_decode import CompiledDecode
from tests.entrypoints.server_process import launch_server

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=None)


def test_requests_run_while_the_graphs_compile(save_hf_model, monkeypatch) -> None:
    """The compile is held until the request is done: the request must finish without it,
    with the eager engine's tokens, and the graphs then compile in the background."""
    path = save_hf_model(MistralForCausalLM(MistralConfig(**SMALL)))
    release, compiled_sizes = threading.Event(), []

    def held_compile_next(self):
        if not self._pending:
            return False
        assert release.wait(60), "the test never released the compile"
        compiled_sizes.append(self._pending.pop(0))
        return True

    monkeypatch.setattr(CompiledDecode, "compile_next", held_compile_next)
    engine = LLMEngine(EngineArgs(model=path, compile_decode=None, kv_cache_memory="16MiB"))
    assert engine.core.runner.compiled_decode.pending == 2
    async_llm = AsyncLLM(lambda: engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 17))}

    async def generate():
        await async_llm.started()
        final = None
        async for final in async_llm.generate(prompt, params):
            pass
        return final

    try:
        final = asyncio.run(asyncio.wait_for(generate(), 60))
        assert compiled_sizes == [] and engine.stats().decode_graphs_pending == 2
        release.set()
        deadline = time.monotonic() + 30
        while engine.stats().decode_graphs_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert compiled_sizes == [1, 2]
    finally:
        release.set()
        async_llm.shutdown()
    eager = LLM(model=path, compile_decode=False, kv_cache_memory="16MiB").generate(prompt, params)[0]
    assert final.outputs[0].token_ids == eager.outputs[0].token_ids


def _content(line: str) -> str:
    """The text a chat stream's SSE line carries, if any."""
    if not line.startswith("data:") or line == "data: [DONE]":
        return ""
    choices = json.loads(line.removeprefix("data:"))["choices"]
    return (choices[0]["delta"].get("content") or "") if choices else ""


@pytest.mark.slow
def test_a_fresh_server_answers_at_once(tmp_path) -> None:
    """serve's CPU defaults (int4 linears, compiled decode) with empty compile caches, less
    batch invariance (which compiles the graphs before serving): the first chat request
    after /health turns 200 gets its first token within 2 s, while the graphs are still
    compiling."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    server = launch_server(tmp_path, "--max-model-len", "2048", "--no-batch-invariant", env=caches,
                           serve_defaults=True)
    try:
        start = time.monotonic()
        body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Say hello."}]}
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            first_token_s = next(time.monotonic() - start for line in response.iter_lines() if _content(line))
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert first_token_s < 2.0, first_token_s
        pending = next(line for line in metrics.splitlines() if line.startswith("kvserve:decode_graphs_pending"))
        assert float(pending.rsplit(" ", 1)[1]) > 0  # still compiling: the request did not wait for it
    finally:
        server.stop()
