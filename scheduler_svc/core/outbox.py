"""What the core reports: events since the last take, and counters since it started."""

from __future__ import annotations

from scheduler_svc.core.request import Request
from scheduler_svc.core.retype import retyping_constructor
from sluice.types import CoreEvents, LifecycleEvent, Stage

_new_lifecycle_event = retyping_constructor(LifecycleEvent)
"""LifecycleEvent's constructor, positional (see retype.py)."""


class Outbox:
    """Lifecycle events, tokens and Finished records not yet taken, and the core's running counters."""

    __slots__ = (
        "events",
        "dropped_total",
        "rounds",
        "preemptions",
        "recomputed_tokens",
        "prefix_hit_tokens",
        "prefix_query_tokens",
        "host_hit_tokens",
    )

    def __init__(self) -> None:
        self.events = CoreEvents()
        self.dropped_total = 0
        """Results dropped since start (unknown round, gone or cancelling request, older epoch)."""
        self.rounds = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.host_hit_tokens = 0
        """Prompt tokens found in the host prefix tier (copied back, not computed)."""

    def take(self) -> CoreEvents:
        """Return the events since the last take and start a new batch."""
        events, self.events = self.events, CoreEvents()
        return events

    def event(
        self, request: Request, stage: Stage, now: float, detail: tuple[tuple[str, int | str], ...] = ()
    ) -> None:
        """Record a lifecycle stage of `request` at `now`."""
        self.events.lifecycle.append(_new_lifecycle_event(request.request_id, stage, now, detail))

    def drop(self, count: int) -> None:
        """Count `count` dropped results (in this batch and in total)."""
        if count > 0:
            self.events.dropped_results += count
            self.dropped_total += count
