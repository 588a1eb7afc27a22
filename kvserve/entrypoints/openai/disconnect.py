"""Stopping a non-streaming request whose client has gone (as vLLM's `with_cancellation`):
a streamed response notices the disconnect when a write fails, but a handler that waits
for the whole result writes nothing until the end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import Response

# nginx's code for "client closed request"; the client never sees it.
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """The handler's response, or, if the client disconnects first, the handler cancelled
    (which aborts its engine requests and frees their KV blocks)."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    return work.result() if not work.cancelled() else Response(status_code=CLIENT_CLOSED_REQUEST)
