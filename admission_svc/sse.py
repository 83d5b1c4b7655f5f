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

`WriteNow` writes events outside the iterator, synchronously, while the iterator is waiting for its next event
(the token reader hands a request's tokens to its client through it: admission_svc/http_edge.py): on a direct
connection only, and only when the socket's buffer has room and the client is there (`ready`); otherwise the
caller leaves the event to the iterator. Since the iterator is waiting, everything it yielded before has been
written: the events stay in order.
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

__all__ = ["CYCLE_SCOPE_KEY", "EventStream", "WriteNow", "direct_writer"]

Write = Callable[[bytes], Awaitable[bool]]
"""Writes one event; returns False once the client is gone (nothing more will reach it)."""


def _chunked_cycle(scope: Scope) -> Any:
    """Return uvicorn's request cycle of `scope`'s response when its head was sent framed chunked by h11 through
    Sluice's protocol; else None."""
    ref = scope.get(CYCLE_SCOPE_KEY)
    cycle = ref() if ref is not None else None
    if cycle is None or type(getattr(cycle.conn, "_writer", None)).__name__ != "ChunkedWriter":
        return None
    return cycle


def _chunk(event: bytes) -> bytes:
    """One event framed as a chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(event), event)


def direct_writer(scope: Scope) -> Write | None:
    """Return a writer of chunks straight onto the connection of `scope`'s response, whose head was sent and was
    framed chunked by h11; None when that is not so (then events go through ASGI sends)."""
    cycle = _chunked_cycle(scope)
    if cycle is None:
        return None
    transport, flow = cycle.transport, cycle.flow

    async def write(event: bytes) -> bool:
        if cycle.disconnected:
            return False
        if flow.write_paused:
            await flow.drain()
        transport.write(_chunk(event))
        return True

    return write


class WriteNow:
    """Writes whole events onto a response's connection at once, when it can (see the module docstring)."""

    __slots__ = ("_cycle", "written")

    def __init__(self) -> None:
        self._cycle: Any = None
        """uvicorn's request cycle, once the response's head went out framed chunked (else None: never ready)."""
        self.written = 0
        """Events written."""

    def bind(self, scope: Scope) -> None:
        """Write onto the connection of `scope`'s response (its head sent) if `direct_writer` could."""
        self._cycle = _chunked_cycle(scope)

    def unbind(self) -> None:
        """The response is ending: write nothing more."""
        self._cycle = None

    def ready(self) -> bool:
        """Whether an event written now goes straight out: bound, the client there, the socket's buffer not full."""
        cycle = self._cycle
        return (cycle is not None and not cycle.disconnected and not cycle.flow.write_paused
                and not cycle.transport.is_closing())

    def __call__(self, event: bytes) -> None:
        """Write one event; call only right after `ready` said True."""
        self._cycle.transport.write(_chunk(event))
        self.written += 1


def _asgi_writer(send: Send) -> Write:
    async def write(event: bytes) -> bool:
        await send({"type": "http.response.body", "body": event, "more_body": True})
        return True

    return write


class EventStream(Response):
    """A text/event-stream response of `events` (each one whole SSE event, as bytes). See the module docstring."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None,
                 background: BackgroundTask | None = None, write_now: WriteNow | None = None) -> None:
        self.events = events
        self.write_now = write_now
        """Bound to the connection once the head is out, unbound when the events end."""
        self.status_code = 200
        self.background = background
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        write = direct_writer(scope) or _asgi_writer(send)
        if self.write_now is not None:
            self.write_now.bind(scope)
        streaming = asyncio.ensure_future(self._stream(write, send))
        watching = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self.write_now is not None:
                self.write_now.unbind()
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

