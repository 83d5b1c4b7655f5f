"""A server-sent-event response that writes each event straight to its connection.

Starlette's StreamingResponse hands every event to the server as an ASGI message: through the middlewares'
send wrappers, uvicorn's cycle and h11's state machine, which frames it as one chunk of a chunked body and
writes it. For the token stream that is a fixed cost per event, paid once per token at low load
(docs/benchmarks.md, "CPU per streamed token"). `EventStream` sends the head and the end of the body the
ordinary ASGI way (so h11 chooses the framing and keeps its state), and writes the events in between as
chunks on the transport itself when the connection allows it:

- the connection is uvicorn's h11 one with Sluice's protocol (admission_svc/http_conn.py), which puts a
  weak reference to its request cycle in the scope under `CYCLE_SCOPE_KEY`;
- h11 chose chunked framing for this response (an HTTP/1.1 client; HTTP/1.0 gets close-delimited framing).

Otherwise (another server, HTTP/1.0) every event goes through ASGI sends, as StreamingResponse does. Either
way the writer honours the transport's flow control (it waits while the socket's buffer is full), stops
writing once the client is gone, and a disconnect seen by `receive` cancels the stream at once (closing the
event iterator, which cancels the request), as StreamingResponse does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

CYCLE_SCOPE_KEY = "sluice.h11_cycle"
"""Scope key of a weak reference to uvicorn's request cycle (set by admission_svc/http_conn.py's protocol)."""

__all__ = ["CYCLE_SCOPE_KEY", "EventStream", "direct_writer"]

Write = Callable[[bytes], Awaitable[bool]]
"""Writes one event; returns False once the client is gone (nothing more will reach it)."""


def direct_writer(scope: Scope) -> Write | None:
    """Return a writer of chunks straight onto the connection of `scope`'s response, whose head was sent and was
    framed chunked by h11; None when that is not so (then events go through ASGI sends)."""
    ref = scope.get(CYCLE_SCOPE_KEY)
    cycle = ref() if ref is not None else None
    if cycle is None or type(getattr(cycle.conn, "_writer", None)).__name__ != "ChunkedWriter":
        return None
    transport, flow = cycle.transport, cycle.flow

    async def write(event: bytes) -> bool:
        if cycle.disconnected:
            return False
        if flow.write_paused:
            await flow.drain()
        transport.write(b"%x\r\n%b\r\n" % (len(event), event))
        return True

    return write


def _asgi_writer(send: Send) -> Write:
    async def write(event: bytes) -> bool:
        await send({"type": "http.response.body", "body": event, "more_body": True})
        return True

    return write


class EventStream(Response):
    """A text/event-stream response of `events` (each one whole SSE event, as bytes). See the module docstring."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None,
                 background: BackgroundTask | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = background
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        write = direct_writer(scope) or _asgi_writer(send)
        streaming = asyncio.ensure_future(self._stream(write, send))
        watching = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
        failure = results[0]
        if isinstance(failure, BaseException) and not isinstance(failure, asyncio.CancelledError):
            raise failure
        if self.background is not None:
            await self.background()

    async def _stream(self, write: Write, send: Send) -> None:
        async with contextlib.aclosing(self.events) as events:
            async for event in events:
                if not await write(event):
                    return  # the client is gone: closing the events cancels the request
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    message: Any = None
    while message is None or message["type"] != "http.disconnect":
        message = await receive()

