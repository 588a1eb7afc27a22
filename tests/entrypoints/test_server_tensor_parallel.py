"""`kvserve serve --tensor-parallel-size 3` on the default model (9 attention heads, 3 KV
heads): three worker processes answer the openai client with the offline engine's tokens;
with one of them killed, /health and new requests say so."""

from __future__ import annotations

import time

import httpx
import openai
import psutil
import pytest
from server_process import launch_server
from test_openai_server import CHAT, MODEL

from kvserve import SamplingParams


def test_three_ranks_answer_the_openai_client(tmp_path, reference_llm):
    server = launch_server(tmp_path, "--tensor-parallel-size", "3", "--max-model-len", "1024")
    try:
        ranks = [child for child in psutil.Process(server.process.pid).children()
                 if "spawn_main" in " ".join(child.cmdline())]
        assert len(ranks) == 3
        reference = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
        chat = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == reference.text
        assert "tensor parallelism: 3 ranks" in server.log()
        # A rank killed: /health says so and new requests are refused, naming it.
        ranks[2].kill()
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{server.base_url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "the rank's death never showed"
            time.sleep(0.1)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "rank 2 exited" in health.json()["reason"]
        with pytest.raises(openai.InternalServerError) as refused:
            server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
        assert refused.value.status_code == 503 and "rank 2 exited" in str(refused.value)
    finally:
        server.stop()
    for rank in ranks:  # their pipes closed with the server: they end too
        rank.wait(timeout=30)
