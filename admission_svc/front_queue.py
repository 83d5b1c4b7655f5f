"""The front door's waiting line: requests over a budget wait for room instead of an immediate 429.

Why: a benchmark or batch client that opens more requests at once than the budgets allow (guidellm's
throughput sweep opens 512) and does not honour Retry-After gets nothing but refusals; vLLM queues them.
With `max_queued_requests` set (globally or per tenant, in the config file's budgets), a request that finds
no room waits, up to `queue_timeout_s`, in its tenant's line; over the bound it is refused at once as before.

Rules: one line per tenant (a tenant whose budget is full never holds up another's requests); first come,
first admitted within a line (a new request queues behind waiting ones even if it would fit); the head of
a line is woken when a reservation is released and re-checks; when it is admitted it wakes the next one,
so one release that frees room for several admits several. A waiter also re-checks every second, for room
the front door did not see being released. Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["FrontQueue"]

RECHECK_S = 1.0
"""Longest a waiter sleeps without re-checking for room."""


class FrontQueue:
    """Per-tenant lines of requests waiting for room at admission."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lines: dict[str, collections.deque[asyncio.Event]] = {}
        self.timeouts = 0
        """Requests that waited their whole timeout without finding room."""
        self._waits = Histogram("sluice_admission_front_queue_wait_seconds",
                                "Time requests waited at the front door for room (max_queued_requests)",
                                registry=registry)
        self._timeouts = Counter("sluice_admission_front_queue_timeouts",
                                 "Requests that waited queue_timeout_s at the front door without finding room",
                                 registry=registry)
        Gauge("sluice_admission_front_queue_waiting", "Requests waiting at the front door for room now",
              registry=registry).set_function(self.waiting)

    def waiting(self, tenant: str | None = None) -> int:
        """Return how many requests wait (of `tenant`, or of every tenant)."""
        if tenant is not None:
            return len(self._lines.get(tenant, ()))
        return sum(len(line) for line in self._lines.values())

    async def wait(self, tenant: str, fits: Callable[[], bool], limit: int | None, timeout_s: float) -> float:
        """Wait until `fits()` holds for this request at the head of its tenant's line, at once when queueing is
        off (`limit` None or 0) or the line is full, or until `timeout_s` passed; return the seconds waited (0
        when it did not queue). The caller admits (or refuses) right after, before any await, so the room it
        saw is still there."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        queued = await self._wait(tenant, fits, limit, timeout_s)
        if not queued:
            return 0.0
        waited = loop.time() - started
        self._waits.observe(waited)
        return waited

    async def _wait(self, tenant: str, fits: Callable[[], bool], limit: int | None, timeout_s: float) -> bool:
        """Return whether the request queued (False: it fits at once, or cannot queue)."""
        line = self._lines.setdefault(tenant, collections.deque())
        if (not line and fits()) or not limit or len(line) >= limit:
            if not line:
                self._lines.pop(tenant, None)
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        me = asyncio.Event()
        line.append(me)
        try:
            while True:
                if line[0] is me and fits():
                    return True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.timeouts += 1
                    self._timeouts.inc()
                    return True
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(remaining, RECHECK_S))
        finally:
            line.remove(me)
            if line:
                line[0].set()  # the next one re-checks: room may be left (or it is the head now)
            if not line:
                self._lines.pop(tenant, None)

    def released(self) -> None:
        """A reservation was released: wake the head of every line to re-check."""
        for line in self._lines.values():
            if line:
                line[0].set()
