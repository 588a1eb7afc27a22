"""The header read timeout closes idle and slow connections, never one whose request arrived in
time, even when the event loop lags (a loaded server) and handles the request's bytes in the same
turn as the expiring timer."""

from __future__ import annotations

import asyncio
import time

from uvicorn.config import Config
from uvicorn.server import ServerState

from kvserve.entrypoints.openai.http_limits import header_timeout_protocol

TIMEOUT_S = 0.3
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    if scope["path"] == "/slow":  # a response that outlasts the header timeout, half sent
        await send({"type": "http.response.body", "body": b"o", "more_body": True})
        await asyncio.sleep(TIMEOUT_S * 3)
        await send({"type": "http.response.body", "body": b"k"})
    else:
        await send({"type": "http.response.body", "body": b"ok"})


async def _serve() -> tuple[asyncio.Server, int]:
    config = Config(app=_ok, lifespan="off", log_level="warning")
    config.load()
    protocol = header_timeout_protocol(TIMEOUT_S)
    state = ServerState()
    server = await asyncio.get_running_loop().create_server(
        lambda: protocol(config=config, server_state=state, app_state={}), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _response(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"ok"), 5)


def test_request_arriving_as_the_idle_timer_expires_on_a_lagging_loop_is_answered():
    async def scenario() -> bytes:
        server, port = await _serve()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await _response(reader)  # now idle between requests: the timer is armed
        writer.write(REQUEST)  # sent at once on loopback
        time.sleep(TIMEOUT_S + 0.2)  # the loop stalls: bytes and timer become due in one turn
        try:
            return await _response(reader)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 200")


def test_response_outlasting_the_timeout_is_not_cut():
    async def scenario() -> bytes:
        server, port = await _serve()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            return await _response(reader)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 200")


def test_connection_idle_past_the_timeout_or_with_partial_headers_is_closed():
    async def scenario(first: bytes) -> float:
        server, port = await _serve()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(first)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without an answer
            return time.monotonic() - started
        finally:
            writer.close()
            server.close()

    for first in (b"", b"GET / HTTP/1.1\r\nHost: x\r\n"):
        assert TIMEOUT_S * 0.9 <= asyncio.run(scenario(first)) < TIMEOUT_S + 2
