"""`kvserve serve --multiprocess-engine-core`: the engine core in a process of its own
serves the same tokens as the offline engine, streamed and not, with gauges that settle."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest
from dashboard_events import EventReader, block_cells, report_counts, state_counts
from server_process import launch_server
from test_openai_server import CHAT, MODEL, PROMPT, metric, stream_completion

from kvserve import SamplingParams


def _core_processes(server) -> list[psutil.Process]:
    """The server's children that multiprocessing spawned (not its resource tracker)."""
    return [child for child in psutil.Process(server.process.pid).children()
            if "spawn_main" in " ".join(child.cmdline())]


@pytest.fixture(scope="module")
def core_process_server(tmp_path_factory):
    proc = launch_server(tmp_path_factory.mktemp("core-process"), "--max-model-len", "1024",
                         "--multiprocess-engine-core")
    yield proc
    proc.stop()


def test_serves_the_offline_engines_tokens(core_process_server, reference_llm):
    server = core_process_server
    assert len(_core_processes(server)) == 1  # the engine core's process
    client = server.client()
    params = SamplingParams(temperature=0, max_tokens=16, stop=["."])
    reference = reference_llm.generate(PROMPT, params)[0].outputs[0]
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["."])
    streamed, _ = stream_completion(client, model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["."])
    assert result.choices[0].text == streamed == reference.text
    assert result.choices[0].finish_reason == reference.finish_reason

    chat_reference = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == chat_reference.text


def test_gauges_settle_after_an_abandoned_stream(core_process_server):
    server = core_process_server
    stream = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=400,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert metric(server, "kvserve:num_requests_running") == 1
    stream.close()  # the server aborts the request; the core reports its gauges once it has
    deadline = time.time() + 20
    while time.time() < deadline and (metric(server, "kvserve:num_requests_running")
                                      or metric(server, "kvserve:kv_cache_usage_perc")):
        time.sleep(0.1)
    assert metric(server, "kvserve:num_requests_running") == 0
    assert metric(server, "kvserve:kv_cache_usage_perc") == 0


def test_the_core_process_exits_with_the_server(tmp_path, tiny_model):
    server = launch_server(tmp_path, "--model", tiny_model, "--multiprocess-engine-core")
    (core,) = _core_processes(server)
    server.stop()  # SIGKILL: the core sees its pipe close
    core.wait(timeout=30)


def test_dashboard_snapshots_come_from_the_core_process(core_process_server):
    server = core_process_server
    events = EventReader(server.base_url)
    try:
        stream = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        # Asked of the core between its steps: the running request holds its blocks alone.
        busy = events.wait_for(lambda e: e["status"] == "ok" and e["num_running"] == 1, timeout=60)
        (row,) = busy["running"]
        assert block_cells(busy)[row["request"]] == row["blocks"] > 0
        assert state_counts(block_cells(busy)) == report_counts(busy["kv"])
        stream.close()
        rest = events.wait_for(lambda e: e["status"] == "ok" and e["time"] > busy["time"] and e["num_running"] == 0)
        assert state_counts(block_cells(rest)) == report_counts(httpx.get(f"{server.base_url}/debug/kv").json())
    finally:
        events.close()
