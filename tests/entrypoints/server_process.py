"""Launching a real `kvserve serve` subprocess on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai

SERVER_TIMEOUT_S = 180


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: str
    saw_503_while_loading: bool

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0,
                             timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_server(log_dir, *args: str, env: dict[str, str] | None = None,
                  serve_defaults: bool = False) -> ServerProcess:
    port = _free_port()
    log_path = os.path.join(str(log_dir), f"server-{port}.log")
    # fp32 weights and eager decode steps, like the offline reference engine these tests
    # compare with, unless `serve_defaults` (--quantization auto and the compiled decode
    # step, also covered in tests/quantization/test_cpu_plan.py and
    # tests/model_executor/test_compiled_decode.py).
    reference = [] if serve_defaults else ["--quantization", "none", "--no-compile-decode"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(port),
             "--kv-cache-memory", "256MiB", *reference, *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(process, base_url, log_path, saw_503_while_loading=False)
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            status = httpx.get(f"{base_url}/health", timeout=5).status_code
        except httpx.TransportError:
            status = None
        if status == 503:
            server.saw_503_while_loading = True
        if status == 200:
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")
