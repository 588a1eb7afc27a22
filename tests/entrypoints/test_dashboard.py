"""The live dashboard on a real server: its event stream's block map against /debug/kv's
counts and against block counts worked out from each request's tokens, its step timeline
and latency windows against the tokens of a request, the page itself, and --no-dashboard.
(The page in a browser: test_dashboard_browser.py; the API key: test_server_lifecycle.py.)"""

from __future__ import annotations

import re
import threading

import httpx
from fastapi.testclient import TestClient

from dashboard_events import EventReader, block_cells, fresh_prompt, report_counts, state_counts, stream_until
from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.openai.server import build_app
from kvserve.entrypoints.openai.serving import ServerState
from kvserve.engine.engine_args import EngineArgs

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the server's default block size


def _complete(server, prompt: list[int], max_tokens: int) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text


def _debug_kv(server) -> dict:
    return httpx.get(f"{server.base_url}/debug/kv").json()


def _idle(event: dict) -> bool:
    return event["status"] == "ok" and event["num_running"] == event["num_waiting"] == 0


def _blocks_for(computed_tokens: int) -> set[int]:
    """A table's length after a step: the blocks of its computed tokens, or one more taken
    for the next token ahead of reading the step (overlapped scheduling)."""
    return {-(-computed_tokens // BLOCK), -(-(computed_tokens + 1) // BLOCK)}


def test_block_map_counts_match_debug_kv_and_each_requests_tokens(server):
    events = EventReader(server.base_url)
    try:
        # At rest nothing changes between the event and the report: equal exactly.
        rest = events.wait_for(_idle)
        assert state_counts(block_cells(rest)) == report_counts(_debug_kv(server))
        assert sum(block_cells(rest).values()) == rest["kv"]["blocks"]["total"]

        # Under load: two prompts of their own and one whose two samples share its blocks.
        shared_prompt = fresh_prompt(2 * BLOCK + 7)
        prompts = {len(p): p for p in (fresh_prompt(21), fresh_prompt(BLOCK + 12), shared_prompt)}
        stop = threading.Event()
        threads = [threading.Thread(target=stream_until,
                                    args=(server.base_url, p, 2 if p is shared_prompt else 1, stop))
                   for p in prompts.values()]
        for thread in threads:
            thread.start()
        try:  # until three snapshots have shown all four samples past their first decode
            events.wait_for(lambda e: e["status"] == "ok" and e["num_running"] == 4
                            and all(row["output_tokens"] >= 2 for row in e["running"]), timeout=120, count=3)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        busy = [e for e in events.events[events.events.index(rest):] if e["status"] == "ok" and e["num_running"]]
        saw_forked = False
        for event in busy:
            cells = block_cells(event)
            # The map against the report of the same moment (pool counters, not a walk).
            assert state_counts(cells) == report_counts(event["kv"])
            rows = event["running"]
            assert set(event["block_map"]["owners"]) <= {row["request"] for row in rows}
            for request in {row["request"] for row in rows}:
                samples = [row for row in rows if row["request"] == request]
                assert samples[0]["prompt_tokens"] in prompts
                # Each request's blocks from its tokens alone: a sample holds its computed
                # tokens' blocks; once forked, the shared prompt's 2 full blocks are held
                # by both samples (shared) and the rest by each alone.
                possible = [_blocks_for(row["computed_tokens"]) for row in samples]
                if len(samples) == 1:
                    assert cells[request] in possible[0]
                    continue
                forked = all(row["output_tokens"] >= 2 for row in samples)
                if forked:  # both have written past the prompt's partial block
                    saw_forked = True
                    assert cells["shared"] == 2
                    assert cells[request] in {a + b - 2 * 2 for a in possible[0] for b in possible[1]}
        assert saw_forked

        # All done: free again, and equal to the report exactly.
        done = events.wait_for(lambda e: _idle(e) and e["time"] > busy[-1]["time"])
        assert state_counts(block_cells(done)) == report_counts(_debug_kv(server))
        assert done["block_map"]["owners"] == [] and done["kv"]["blocks"]["used"] == 0
    finally:
        events.close()


def test_steps_and_latency_windows_count_a_requests_tokens(server):
    prompt, max_tokens = fresh_prompt(20), 6
    events = EventReader(server.base_url)
    try:
        start = events.wait_for(_idle)  # the engine records steps from this snapshot on
        _complete(server, prompt, max_tokens)
        done = events.wait_for(lambda e: _idle(e) and e["time"] > start["time"] and e["latency"]["output_tokens"] == 0
                               and e["steps"] == [])
        window = events.events[events.events.index(start) + 1:events.events.index(done) + 1]
        steps = [step for event in window for step in event["steps"]]
        # Its 20 prompt tokens prefilled (none cached), then 5 decode steps of 1 token: the
        # first token comes from the prefill step.
        assert sum(step[1] for step in steps) == len(prompt)
        assert [step[2:] for step in steps if step[2]] == [[1, 1, 0]] * (max_tokens - 1)
        assert sum(step[4] for step in steps) == 0
        latency = [event["latency"] for event in window]
        assert sum(w["output_tokens"] for w in latency) == max_tokens
        assert sum(w["ttft"]["count"] for w in latency) == 1
        assert sum(w["itl"]["count"] for w in latency) == max_tokens - 1
        assert all(w["ttft"]["max"] > 0 for w in latency if w["ttft"]["count"])
    finally:
        events.close()


def test_the_page_is_self_contained(server):
    response = httpx.get(f"{server.base_url}/dashboard")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<canvas id=\"block-map\"" in page and "EventSource" in page
    # Nothing fetched from elsewhere (the machine may have no internet): no script or style
    # sources, imports, url() or absolute URLs.
    assert not re.search(r"\b(src|href)\s*=|@import|url\(|://", page)


def test_no_dashboard_flag_removes_the_routes():
    parser = build_parser()
    assert parser.parse_args(["serve"]).dashboard is True
    assert parser.parse_args(["serve", "--no-dashboard"]).dashboard is False
    # The routes exist or not from the start, before the model loads (no lifespan here).
    for dashboard, expected in ((True, 200), (False, 404)):
        client = TestClient(build_app(ServerState(EngineArgs(), MODEL, dashboard=dashboard)))
        assert client.get("/dashboard").status_code == expected
    assert client.get("/dashboard/events").status_code == 404
