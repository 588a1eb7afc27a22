"""Stand-in workers for the router's failure paths: small ASGI apps on loopback threads."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def fake_worker(model: str, mode: str = "ok", adapters: tuple[str, ...] = (),
                running_adapters: tuple[str, ...] = ()) -> FastAPI:
    """An OpenAI-ish completions server. mode "ok" streams three chunks; "die_mid_stream"
    sends one and then drops the connection; "slow" takes 0.2 s to answer. `adapters`: LoRA
    adapters it lists (with `model` as parent), `running_adapters` those its lora_requests_info
    metric says run on it."""
    app = FastAPI()
    app.state.requests = 0
    app.state.models_requested = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model"}] + [
            {"id": name, "object": "model", "parent": model} for name in adapters]}

    @app.get("/metrics")
    async def metrics():
        running = ",".join(running_adapters)
        return PlainTextResponse(
            "# TYPE kvserve:lora_requests_info gauge\n"
            f'kvserve:lora_requests_info{{max_lora="4",running_lora_adapters="{running}",'
            f'waiting_lora_adapters=""}} 1.7e9\n')

    @app.post("/v1/completions")
    async def completions(body: dict):
        app.state.requests += 1
        app.state.models_requested.append(body.get("model"))
        if mode == "slow":
            await asyncio.sleep(0.2)
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "abc", "index": 0}], "worker": mode})

        async def events():
            yield f"data: {json.dumps({'choices': [{'text': 'a', 'index': 0}]})}\n\n"
            if mode == "die_mid_stream":
                await asyncio.sleep(0.05)
                raise RuntimeError("worker died")
            for text in ("b", "c"):
                yield f"data: {json.dumps({'choices': [{'text': text, 'index': 0}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class ThreadServer:
    """A uvicorn server on a free loopback port in a daemon thread."""

    def __init__(self, app, port: int | None = None) -> None:
        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def health_only() -> FastAPI:
    """A server that answers /health but is no OpenAI server."""
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    return app


def free_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"
