"""The event stream written straight to the connection: intact chunked framing for HTTP/1.1 (and the fast path
taken), close-delimited framing for HTTP/1.0, keep-alive after it, and a client that leaves cancelling it while
no event flows. A real uvicorn server with the edge's protocol on loopback, raw sockets as clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from admission_svc.http_conn import HttpTimeouts, closed_counter, protocol_class
from admission_svc.http_edge import HttpServer
from admission_svc.sse import EventStream, direct_writer

EVENTS = [b"data: %d\n\n" % i for i in range(50)] + [b"data: " + b"x" * 300_000 + b"\n\n", b"data: [DONE]\n\n"]


class Probe:
    """What the test app saw: whether the fast path applied, and whether the events' iterator was closed."""

    def __init__(self) -> None:
        self.direct: list[bool] = []
        self.closed = asyncio.Event()
        self.hang = False


def _app(probe: Probe) -> Starlette:
    async def events(request: Request) -> AsyncIterator[bytes]:
        probe.direct.append(direct_writer(request.scope) is not None)
        try:
            for event in EVENTS:
                yield event
            if probe.hang:
                await asyncio.Event().wait()  # no event flows: only the disconnect can end it
        finally:
            probe.closed.set()

    async def stream(request: Request) -> Response:
        return EventStream(events(request), headers={"cache-control": "no-cache"})

    return Starlette(routes=[Route("/s", stream, methods=["GET"])])


async def _serving(probe: Probe, work: Callable[[int], Awaitable[Any]]) -> Any:
    protocol = protocol_class(HttpTimeouts(), closed_counter(CollectorRegistry()))
    server = HttpServer(_app(probe), "127.0.0.1", 0, protocol=protocol)
    await server.start()
    try:
        return await work(server.port)
    finally:
        await server.stop()


async def _read_head(reader: asyncio.StreamReader) -> dict[str, str]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    assert lines[0].endswith("200 OK"), lines[0]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        chunk = await reader.readexactly(size + 2)
        assert chunk.endswith(b"\r\n")
        if size == 0:
            return bytes(body)
        body += chunk[:-2]


def test_http11_gets_every_event_in_chunked_framing_and_keeps_the_connection() -> None:
    """An HTTP/1.1 client reads every event (a large one too, past the socket buffer) as valid chunks ending in
    the last chunk; the fast path was taken; the same connection then serves a second stream."""
    probe = Probe()

    async def work(port: int) -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        bodies = []
        for _ in range(2):
            writer.write(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
            headers = await _read_head(reader)
            assert headers["transfer-encoding"] == "chunked"
            assert headers["content-type"].startswith("text/event-stream")
            bodies.append(await _read_chunked(reader))
        writer.close()
        return bodies

    bodies = asyncio.run(_serving(probe, work))
    assert bodies == [b"".join(EVENTS)] * 2
    assert probe.direct == [True, True]


def test_http10_gets_every_event_close_delimited() -> None:
    """An HTTP/1.0 client (no chunked framing) gets the events through ASGI sends, the body ending at close."""
    probe = Probe()

    async def work(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.0\r\n\r\n")
        headers = await _read_head(reader)
        assert "transfer-encoding" not in headers
        body = await reader.read()
        writer.close()
        return body

    assert asyncio.run(_serving(probe, work)) == b"".join(EVENTS)
    assert probe.direct == [False]


def test_client_leaving_while_no_event_flows_closes_the_events() -> None:
    """A client that disconnects while the stream waits for its next event closes the event iterator (which,
    in the edge, cancels the request) without another event having to come."""
    probe = Probe()
    probe.hang = True

    async def work(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
        await _read_head(reader)
        await reader.readexactly(len(b"".join(EVENTS)) // 2)
        writer.close()
        await asyncio.wait_for(probe.closed.wait(), 10)

    asyncio.run(_serving(probe, work))
    assert probe.closed.is_set()
