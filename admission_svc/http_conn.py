"""HTTP connections that cannot be held open for free: a deadline for each request head, one for idleness.

uvicorn (h11) times a connection out only between two requests of a keep-alive connection, and only once
its first response is sent: a client that connects and sends nothing, or sends its headers a byte every
few seconds (slowloris), holds a socket and its buffers for as long as it likes (only the fd limit bounded
them). `TimedH11Protocol` arms a deadline when a connection opens and again after each response: the whole
request head must have arrived by then, or the connection is closed (counted in
`sluice_admission_http_connections_closed_total{reason="header_timeout"}`). The body is read by the route
under the size limit and a deadline (`body_s`, from when the route starts reading it): a body sent a few bytes
at a time (slowloris on the body) is answered 408 and its connection closed (reason="body_timeout"; the route
does it, admission_svc/http_edge.py). A response being streamed is never cut. Idle keep-alive connections close
after `keepalive_s` (uvicorn's own timer, reason "keepalive" is not counted: it is the normal end of one).

The protocol also puts a weak reference to each request's cycle in its scope, so that a streamed response can
write its events straight to the connection (admission_svc/sse.py).
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Any

import h11
from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

from admission_svc.sse import CYCLE_SCOPE_KEY

HTTP_HEADER_TIMEOUT_S = 10.0
"""Default seconds a connection has to send a whole request head (from opening, or from its last response)."""
HTTP_KEEPALIVE_TIMEOUT_S = 5.0
"""Default seconds an idle keep-alive connection stays open (uvicorn's default)."""
HTTP_BODY_TIMEOUT_S = 30.0
"""Default seconds a request has to send its whole body once its head is in: the largest body admission takes
(max_message_bytes, 2 MiB) at ~70 KB/s, far slower than any real client on the links admission serves."""


@dataclass(frozen=True)
class HttpTimeouts:
    """The HTTP edge's connection deadlines."""

    header_s: float = HTTP_HEADER_TIMEOUT_S
    """A connection that has not sent a whole request head this long after it opened, or after its last response
    was sent, is closed."""
    keepalive_s: float = HTTP_KEEPALIVE_TIMEOUT_S
    """An idle keep-alive connection is closed after this long."""
    body_s: float = HTTP_BODY_TIMEOUT_S
    """A request whose whole body has not arrived this long after its route started reading it is answered 408 and
    its connection closed."""


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline (module docstring). Made per server by `protocol_class`."""

    header_timeout_s: float = HTTP_HEADER_TIMEOUT_S
    closed: Counter | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete (or the connection is over)
            self._disarm_head_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and CYCLE_SCOPE_KEY not in cycle.scope:
            # lets a streamed response write its events straight to the connection (admission_svc/sse.py)
            cycle.scope[CYCLE_SCOPE_KEY] = weakref.ref(cycle)  # type: ignore[literal-required]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_deadline()  # the next request's head has the same deadline

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.closed is not None:
            self.closed.labels("header_timeout").inc()
        self.transport.close()


def closed_counter(registry: CollectorRegistry) -> Counter:
    """Return the counter of connections the edge closes, by reason (header_timeout, body_timeout)."""
    return Counter("sluice_admission_http_connections_closed", "HTTP connections the edge closed, by reason",
                   ["reason"], registry=registry)


def protocol_class(timeouts: HttpTimeouts, closed: Counter) -> type[TimedH11Protocol]:
    """Return the protocol class for one server: its header deadline, and the counter of connections it closes."""
    return type("ServerH11Protocol", (TimedH11Protocol,), {"header_timeout_s": timeouts.header_s, "closed": closed})
