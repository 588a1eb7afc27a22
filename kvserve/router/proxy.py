"""Forwarding one request: pick a worker, send, retry elsewhere until the first byte,
then pass the bytes through as they come."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from kvserve.router.errors import RouterError
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import Policy
from kvserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

# Request headers passed to the worker; the rest (Host, Content-Length) httpx sets.
_FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
# Response headers passed back; hop-by-hop ones and the length (the body streams) are not.
_DROPPED_RESPONSE_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                             "date", "server"}
# A worker answering 503 is loading or draining: another one may take the request.
_RETRY_STATUSES = {503}


@dataclass
class Upstream:
    worker: Worker
    response: httpx.Response
    chunks: AsyncIterator[bytes]  # the rest of the body, after first_chunk
    first_chunk: bytes


# A worker running the requested adapter is preferred while it has at most this many more
# requests in flight than the least loaded candidate.
ADAPTER_AFFINITY_MAX_EXTRA_LOAD = 8


def adapter_affinity(model: str, workers: list[Worker]) -> list[Worker]:
    """For a LoRA adapter, the workers that already run it (its weights in their slots, so
    no load and no eviction of another adapter), unless they are busier than the others by
    more than ADAPTER_AFFINITY_MAX_EXTRA_LOAD; else all of them."""
    running = [w for w in workers if model in w.running_adapters]
    least = min(w.outstanding for w in workers)
    if running and min(w.outstanding for w in running) <= least + ADAPTER_AFFINITY_MAX_EXTRA_LOAD:
        return running
    return workers


class Forwarder:
    def __init__(self, pool: WorkerPool, policy: Policy, client: httpx.AsyncClient,
                 metrics: RouterMetrics, max_attempts: int, retry_down_s: float,
                 has_room: Callable[[Worker], bool]) -> None:
        self.pool = pool
        self.has_room = has_room
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.retry_down_s = retry_down_s

    async def forward(self, path: str, model: str, body: bytes, key, headers: dict[str, str],
                      wait_disconnect: Callable[[], Awaitable[None]],
                      release: Callable[[Worker], None]) -> Response:
        """The worker's response to the request, streamed. `release` runs once the request
        is done with its worker (answered, failed or abandoned)."""
        forwarded = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_REQUEST_HEADERS}
        tried: set[str] = set()
        last_failure = "no worker answered"
        for _ in range(self.max_attempts):
            candidates = [w for w in self.pool.healthy_for(model) if w.url not in tried]
            # Admission let the request in because some worker had room: prefer those.
            candidates = [w for w in candidates if self.has_room(w)] or candidates
            if not candidates:
                break
            candidates = adapter_affinity(model, candidates)
            worker, branch = self.policy.choose(model, candidates, key)
            self.metrics.routing_decisions.labels(self.policy.name, branch).inc()
            self.metrics.requests.labels(worker.url, model).inc()
            tried.add(worker.url)
            self._acquire(worker)
            try:
                upstream = await self._first_byte(worker, path, body, forwarded, wait_disconnect)
            except _ClientGone:
                self._release(worker, release)
                return Response(status_code=499)
            except _WorkerFailed as failure:
                self._release(worker, release)
                last_failure = f"{worker.url}: {failure}"
                logger.warning("request to %s failed before its first byte (%s); retrying elsewhere",
                               worker.url, failure)
                self.metrics.retries.labels(worker.url).inc()
                continue
            except BaseException:
                self._release(worker, release)
                raise
            return self._stream(upstream, lambda: self._release(worker, release))
        if not tried:
            raise RouterError(503, f"no healthy worker serves model {model!r}",
                              type="service_unavailable", code="no_healthy_worker")
        self.metrics.rejected.labels("all_attempts_failed").inc()
        raise RouterError(503, f"every worker tried failed; last: {last_failure}",
                          type="service_unavailable", code="no_healthy_worker")

    def _acquire(self, worker: Worker) -> None:
        worker.outstanding += 1
        self.metrics.outstanding.labels(worker.url).set(worker.outstanding)

    def _release(self, worker: Worker, release: Callable[[Worker], None]) -> None:
        worker.outstanding -= 1
        self.metrics.outstanding.labels(worker.url).set(worker.outstanding)
        release(worker)

    async def _first_byte(self, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                          wait_disconnect: Callable[[], Awaitable[None]]) -> Upstream:
        """Send and read the first chunk of the answer, while watching the client: one that
        leaves takes the upstream request with it."""
        attempt = asyncio.ensure_future(self._send(worker, path, body, headers))
        gone = asyncio.ensure_future(wait_disconnect())
        try:
            await asyncio.wait({attempt, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not attempt.done():
                attempt.cancel()  # closes the upstream connection: the worker aborts
        if attempt.cancelled():
            raise _ClientGone()
        return attempt.result()

    async def _send(self, worker: Worker, path: str, body: bytes,
                    headers: dict[str, str]) -> Upstream:
        request = self.client.build_request("POST", worker.url + path, content=body, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.ConnectError as error:
            self.metrics.errors.labels(worker.url, "connect").inc()
            self.pool.mark_down(worker, f"connection failed: {error}", self.retry_down_s)
            self.policy.forget(worker)
            raise _WorkerFailed(f"connection failed: {error}") from None
        except httpx.HTTPError as error:
            self.metrics.errors.labels(worker.url, "no_answer").inc()
            raise _WorkerFailed(f"{type(error).__name__}: {error}") from None
        try:
            if response.status_code in _RETRY_STATUSES:
                raise _WorkerFailed(f"answered {response.status_code}")
            chunks = response.aiter_raw()
            try:
                first_chunk = await chunks.__anext__()
            except StopAsyncIteration:
                first_chunk = b""
        except httpx.HTTPError as error:
            self.metrics.errors.labels(worker.url, "no_answer").inc()
            await response.aclose()
            raise _WorkerFailed(f"{type(error).__name__}: {error}") from None
        except BaseException:
            await response.aclose()
            raise
        return Upstream(worker, response, chunks, first_chunk)

    def _stream(self, upstream: Upstream, done: Callable[[], None]) -> Response:
        response = upstream.response
        headers = {k: v for k, v in response.headers.items()
                   if k.lower() not in _DROPPED_RESPONSE_HEADERS}
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            # Starlette cancels this generator when the client disconnects; closing the
            # upstream response then drops the worker's connection, which aborts its request.
            try:
                if upstream.first_chunk:
                    yield upstream.first_chunk
                async for chunk in upstream.chunks:
                    yield chunk
            except httpx.HTTPError as error:
                self.metrics.errors.labels(upstream.worker.url, "mid_stream").inc()
                logger.warning("worker %s failed mid-response: %s", upstream.worker.url, error)
                if is_sse:
                    yield _sse_error(f"worker failed mid-stream: {type(error).__name__}")
            finally:
                done()  # first: closing may be cancelled along with this generator
                await response.aclose()

        return _ClosingStreamingResponse(body(), status_code=response.status_code, headers=headers)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends. Starlette stops iterating when a
    write to a gone client fails but leaves the generator to the garbage collector, which
    would hold the upstream request open until then."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None,
                       "code": "worker_failed"}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class _WorkerFailed(Exception):
    pass


class _ClientGone(Exception):
    pass
