"""Limits on what a connection may cost before its request reaches a handler: how long its
headers and its body may take to arrive and how large the body may be. Without them a
client that sends slowly, or nothing, holds a connection (and a buffer) forever."""

from __future__ import annotations

import asyncio
import json

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from kvserve.entrypoints.openai.errors import OpenAIError


def header_timeout_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, closing a connection whose request headers have not all
    arrived `timeout` seconds after it opened or after its previous response ended (uvicorn
    only times out connections that are idle between requests)."""
    base = import_from_string(HTTP_PROTOCOLS["auto"])

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(timeout, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            # uvicorn starts a request cycle the moment its headers are parsed, but the handler
            # task only runs on a later loop turn: on a lagging loop the bytes and this timer
            # are handled in the same turn, so a request that made it in time is in a cycle.
            if self._request_in_progress() or self.transport.is_closing():
                return
            self.transport.close()

        def _request_in_progress(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

    return HeaderTimeoutProtocol


class RequestBodyLimits:
    """ASGI middleware: reads the whole body first, answering 413 beyond `max_body_size`
    bytes (from Content-Length at once, else as it arrives) and 408 if it is not complete
    `body_timeout` seconds after the headers; then hands the app the buffered body. Both
    answers close the connection, whose unread bytes would otherwise start a next request."""

    def __init__(self, app, max_body_size: int, body_timeout: float) -> None:
        self.app = app
        self.max_body_size = max_body_size
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_body_size:
            await self._refuse(send, self._too_large())
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_size:
                        await self._refuse(send, self._too_large())
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._refuse(send, OpenAIError(
                408, f"the request body did not arrive within {self.body_timeout:g} s "
                "(--body-read-timeout)", code="request_timeout"))
            return
        buffered = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            # Afterwards the real channel: handlers watch it for the client's disconnect.
            return buffered.pop() if buffered else await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body exceeds {self.max_body_size} bytes "
                           "(--max-body-size)", code="request_too_large")

    @staticmethod
    async def _refuse(send, error: OpenAIError) -> None:
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status_code, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body})
