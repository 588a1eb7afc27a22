"""What `kvserve router` adds to a request: the same requests sent to a worker directly and
through a router in front of it, alternated so that load from elsewhere falls on both alike.

Against a null worker (an in-process OpenAI-shaped server that answers at once, so the
router's own cost is all there is to see): the latency of sequential non-streaming
requests, p50 and p90, direct and routed; and the chunks per second of `--concurrency`
concurrent streams of `--stream-chunks` chunks each. The router runs as its own process
(`kvserve router --worker URL`), as deployed.

    python -m kvserve.benchmarks.router_overhead --requests 400 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

MODEL = "null-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_null_worker(stream_chunks: int) -> str:
    """A worker that answers completions at once (streams `stream_chunks` chunks), on a
    loopback port in a daemon thread; returns its URL."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]})

        async def events():
            chunk = "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\n\n"
            for _ in range(stream_chunks):
                yield chunk
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url)
    return url


def start_router(worker_url: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "WARNING", "router",
         "--host", "127.0.0.1", "--port", str(port), "--worker", worker_url],
        stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, process)
    return process, url


def _wait_healthy(url: str, process: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:.0f} s")


def sequential_latencies(urls: dict[str, str], requests: int) -> dict[str, list[float]]:
    """Seconds of each non-streaming request, the targets alternated request by request."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    with httpx.Client(timeout=30.0) as client:
        for name, url in urls.items():  # warm the connections
            client.post(url + "/v1/completions", json=body).raise_for_status()
        for _ in range(requests):
            for name, url in urls.items():
                start = time.perf_counter()
                client.post(url + "/v1/completions", json=body).raise_for_status()
                latencies[name].append(time.perf_counter() - start)
    return latencies


async def _stream_rate(url: str, concurrency: int) -> float:
    """Chunks per second received by `concurrency` concurrent streams."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": True}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        async def one() -> int:
            chunks = 0
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
            return chunks

        start = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(concurrency)))
        return sum(counts) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400,
                        help="sequential non-streaming requests to each target")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    parser.add_argument("--stream-chunks", type=int, default=256, help="chunks in each stream")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the streaming test")
    parser.add_argument("--output-json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)

    worker = start_null_worker(args.stream_chunks)
    router, router_url = start_router(worker)
    try:
        urls = {"direct": worker, "router": router_url}
        latencies = sequential_latencies(urls, args.requests)
        rates: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(args.rounds):
            for name, url in urls.items():
                rates[name].append(asyncio.run(_stream_rate(url, args.concurrency)))
    finally:
        router.terminate()
        router.wait(timeout=30)
    result = {}
    for name in urls:
        ordered = sorted(latencies[name])
        result[name] = {"p50_ms": 1e3 * statistics.median(ordered),
                        "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
                        "stream_chunks_per_s": statistics.median(rates[name])}
        print(f"{name:7s} latency p50 {result[name]['p50_ms']:.2f} ms, p90 {result[name]['p90_ms']:.2f} ms; "
              f"{args.concurrency} streams: {result[name]['stream_chunks_per_s']:.0f} chunks/s "
              f"(median of {args.rounds})")
    added = result["router"]["p50_ms"] - result["direct"]["p50_ms"]
    capacity = result["router"]["stream_chunks_per_s"] / result["direct"]["stream_chunks_per_s"]
    print(f"the router adds {added:.2f} ms at p50; its streams carry {capacity:.2f}x the direct chunk rate")
    result.update(added_p50_ms=added, stream_rate_ratio=capacity, requests=args.requests,
                  concurrency=args.concurrency, stream_chunks=args.stream_chunks)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
