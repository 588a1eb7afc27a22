"""`kvserve serve --tensor-parallel-size 2` on a tiny model: two worker processes answer the
openai client with the offline engine's tokens; with one of them killed, /health and new
requests say so."""

from __future__ import annotations

import time

import httpx
import openai
import psutil
import pytest
from server_process import launch_server

from kvserve import LLM, SamplingParams

PROMPT = "t5 t9 t17 t33"


def test_two_ranks_answer_the_openai_client(tmp_path, tiny_model):
    reference = LLM(model=tiny_model, kv_cache_memory="16MiB").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    server = launch_server(tmp_path, "--model", tiny_model, "--served-model-name", "tiny",
                           "--tensor-parallel-size", "2")
    try:
        ranks = [child for child in psutil.Process(server.process.pid).children()
                 if "spawn_main" in " ".join(child.cmdline())]
        assert len(ranks) == 2
        completion = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                        extra_body={"ignore_eos": True})
        assert len(reference.token_ids) == 8 and completion.choices[0].text == reference.text
        assert "tensor parallelism: 2 ranks" in server.log()
        # A rank killed: /health says so and new requests are refused, naming it.
        ranks[1].kill()
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{server.base_url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "the rank's death never showed"
            time.sleep(0.1)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "rank 1 exited" in health.json()["reason"]
        with pytest.raises(openai.InternalServerError) as refused:
            server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
        assert refused.value.status_code == 503 and "rank 1 exited" in str(refused.value)
    finally:
        server.stop()
    for rank in ranks:  # their pipes closed with the server: they end too
        rank.wait(timeout=30)
