"""guidellm, the vLLM project's load tool, against `kvserve serve` on the default model: every
request it sends succeeds (it streams chat completions with vLLM's extensions:
`stream_options.continuous_usage_stats`, `ignore_eos`, `max_completion_tokens`, `stop: null`).

guidellm pins its own dependencies, so it runs from a venv of its own; benchmarks/guidellm.sh
creates one. Point KVSERVE_GUIDELLM at its executable, or put it on PATH:

    KVSERVE_GUIDELLM=~/.cache/kvserve/guidellm-venv/bin/guidellm python -m pytest -m slow tests/reliability/test_guidellm.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.entrypoints.server_process import launch_server

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "guidellm.sh"
NUM_REQUESTS = 16
OUTPUT_TOKENS = 8


def _guidellm() -> str:
    found = os.environ.get("KVSERVE_GUIDELLM") or shutil.which("guidellm")
    if not found:
        pytest.skip("guidellm not found: set KVSERVE_GUIDELLM to its executable or put it on PATH "
                    "(python -m venv --system-site-packages VENV && VENV/bin/pip install guidellm, "
                    "or run benchmarks/guidellm.sh once)")
    return found


@pytest.mark.slow
def test_guidellm_benchmark_has_no_failed_requests(tmp_path):
    guidellm = _guidellm()
    server = launch_server(tmp_path, "--max-model-len", "1024", serve_defaults=True)
    report_path = tmp_path / "guidellm.json"
    try:
        run = subprocess.run(
            ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1500,
            env={**os.environ, "GUIDELLM": guidellm, "TARGET": server.base_url, "OUTPUT": str(report_path),
                 "REQUESTS": str(NUM_REQUESTS), "STREAMS": "4", "PROMPT_TOKENS": "32",
                 "OUTPUT_TOKENS": str(OUTPUT_TOKENS)})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        (benchmark,) = json.loads(report_path.read_text())["benchmarks"]
        totals = benchmark["metrics"]["request_totals"]
        assert totals == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0, "total": NUM_REQUESTS}, (
            totals, server.log()[-5000:])
        # ignore_eos is honoured and the streamed usage reaches guidellm: exactly the asked length
        assert [r["output_tokens"] for r in benchmark["requests"]["successful"]] == [OUTPUT_TOKENS] * NUM_REQUESTS
        assert "Traceback" not in server.log()
    finally:
        server.stop()
