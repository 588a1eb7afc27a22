"""`kvserve serve --tensor-parallel-size 3` on the default model (9 attention heads, 3 KV
heads): three worker processes answer the openai client with the offline engine's tokens."""

from __future__ import annotations

import psutil
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
    finally:
        server.stop()
    for rank in ranks:  # their pipes closed with the server: they end too
        rank.wait(timeout=30)
