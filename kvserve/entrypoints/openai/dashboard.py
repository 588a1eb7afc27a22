"""The live dashboard: GET /dashboard is one self-contained HTML page (inline script and
styles, no build step, nothing fetched from elsewhere), and GET /dashboard/events an SSE
stream of the engine's own state that the page draws: the KV block map, the running and
waiting queues, the batch timeline and the latency and throughput charts.

One producer serves every open page: while any is open it takes a snapshot of the engine
(between two steps, on the engine's thread) every DASHBOARD_INTERVAL_S and sends it to
each; while none is open it takes none."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from kvserve.entrypoints.openai.api_key import has_bearer_key, has_key_cookie, missing_key_error
from kvserve.entrypoints.openai.serving import ServerState, sse
from kvserve.metrics import LatencyWindow

logger = logging.getLogger(__name__)

# 2 Hz: a snapshot walks every KV block on the engine's thread, between steps.
DASHBOARD_INTERVAL_S = 0.5
# A page that reads slower than the feed skips snapshots instead of holding them.
_MAX_QUEUED_EVENTS = 4

_PAGE = resources.files(__package__).joinpath("dashboard.html").read_text()
_KEY_FORM = """<!doctype html><meta charset="utf-8"><title>kvserve dashboard</title>
<body style="font:14px system-ui;margin:3em">
<form onsubmit="document.cookie='kvserve_api_key='+encodeURIComponent(this.key.value)+
'; path=/dashboard; SameSite=Strict'; location.reload(); return false">
<p>This server needs its API key (--api-key) to show the dashboard.</p>
<input name="key" type="password" autofocus placeholder="API key"> <button>Open</button>
</form>"""


def _summary(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "max": None}
    return {"count": len(values), "mean": sum(values) / len(values), "max": max(values)}


def latency_summary(window: LatencyWindow) -> dict[str, Any]:
    """A window's charts: time to first token and inter-token latency (seconds), and the
    output tokens per second of every stream together."""
    return {
        "window_s": window.seconds,
        "output_tokens": window.output_tokens,
        "output_tokens_per_s": window.output_tokens / window.seconds if window.seconds else 0.0,
        "ttft": _summary(window.time_to_first_token),
        "itl": _summary(window.inter_token_latency),
    }


class DashboardFeed:
    def __init__(self, state: ServerState, interval_s: float = DASHBOARD_INTERVAL_S) -> None:
        self._state = state
        self._interval_s = interval_s
        self._subscribers: set[asyncio.Queue[str]] = set()
        self._producer: asyncio.Task | None = None

    async def events(self) -> AsyncIterator[str]:
        """SSE events for one page, until it leaves or the server drains."""
        events: asyncio.Queue[str] = asyncio.Queue(maxsize=_MAX_QUEUED_EVENTS)
        self._subscribers.add(events)
        if self._producer is None or self._producer.done():
            self._producer = asyncio.create_task(self._produce())
        try:
            while not self._state.draining:
                yield await events.get()
        finally:
            self._subscribers.discard(events)

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        while self._subscribers:
            started = loop.time()
            try:
                event = sse(await self._snapshot())
            except Exception as error:  # a page shows it; the feed goes on
                logger.exception("dashboard snapshot failed")
                event = sse({"status": "error", "reason": repr(error)})
            for events in self._subscribers:
                if events.full():
                    events.get_nowait()
                events.put_nowait(event)
            await asyncio.sleep(max(0.0, self._interval_s - (loop.time() - started)))

    async def _snapshot(self) -> dict[str, Any]:
        state = self._state
        if state.async_llm is None:
            return {"status": "loading" if state.load_error is None else "failed"}
        engine = await state.async_llm.dashboard_snapshot()
        return {"status": "ok", "time": time.time(), "model": state.served_model_name,
                "interval_s": self._interval_s, **engine,
                "latency": latency_summary(state.metrics.recent.take())}


def dashboard_router(state: ServerState) -> APIRouter:
    """/dashboard and /dashboard/events, behind the API key when the server has one (the
    header, or the cookie the page's key form sets)."""
    router = APIRouter(include_in_schema=False)
    feed = DashboardFeed(state)

    def authorized(request: Request) -> bool:
        key = state.api_key
        return key is None or has_bearer_key(request, key) or has_key_cookie(request, key)

    @router.get("/dashboard")
    async def page(request: Request) -> Response:
        if not authorized(request):
            return HTMLResponse(_KEY_FORM, status_code=401)
        return HTMLResponse(_PAGE)

    @router.get("/dashboard/events")
    async def events(request: Request) -> Response:
        if not authorized(request):
            raise missing_key_error()
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router
