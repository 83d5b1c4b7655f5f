"""Asking schedulers about quiet requests (Lookup), and judging the completions that fetched.

Rules
-----
* Each watchdog tick (admission_svc/migration.py) asks the scheduler of every stalled request on a listed, healthy
  replica about it. A request the scheduler neither holds nor remembers moves (UNKNOWN_AT_SCHEDULER). A completion
  it remembers ends the request at once, as if it had come from the bus.
* Such a fetch is not called a loss: most fetched completions are only late on the bus, and the fetch cannot tell
  (admission_svc/fetched.py says why). It is logged at INFO and gets span event `completion_fetched`; then its bus
  copy arriving judges it `late` (DEBUG), and none within `completion_fetch_grace_s` (30 s) judges it `lost`: the
  WARNING "... lost on the bus" then names the request and the seconds since the fetch. Metric
  `sluice_admission_completions_fetched_total{outcome="late"|"lost"|"unresolved"}` (unresolved: forgotten unjudged,
  more than `max_fetches_awaited` waiting); span event `completion_late` or `completion_lost` while the request's
  span has not ended.
* Only a completion the request still waited for counts as fetched: not one whose bus copy came first (before or
  during the Lookup: `Tracked.bus_completions`), nor one of a request that ended or moved on meanwhile.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
from opentelemetry.context import Context

from admission_svc.fetched import FetchedCompletions, FetchOutcome, FetchVerdict
from admission_svc.migration import MigrationCause, Stalled
from sluice.prom import zero_series
from sluice.v1 import common_pb2, events_pb2, scheduler_pb2

if TYPE_CHECKING:
    from admission_svc.calls import Tracked
    from admission_svc.frontdoor import FrontDoor

log = logging.getLogger(__name__)

__all__ = ["FROM_LOOKUP", "Lookups"]

FROM_LOOKUP = "lookup"
"""The entry id FrontDoor.on_completion gets with a completion a Lookup fetched (bus entries carry Redis ids)."""


class Lookups:
    """The watchdog's Lookups and the ledger of what they fetched (see the module docstring)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.fetches = FetchedCompletions(door.config.completion_fetch_grace_s, door.config.max_fetches_awaited)
        zero_series(door.metrics.completions_fetched, (outcome.value for outcome in FetchOutcome))

    async def look_up(self, stalled: list[Stalled]) -> None:
        """Ask each scheduler about its quiet requests: a completion it remembers is handled as if it came from
        the bus; a request it does not hold at all moves (UNKNOWN_AT_SCHEDULER)."""
        by_address: dict[str, list[tuple[Tracked, str]]] = {}
        for quiet in stalled:
            record = self.door.records.get(quiet.request_id)
            if record is not None and record.attempt_id:
                by_address.setdefault(quiet.scheduler_address, []).append((record, record.attempt_id))
        for address, asked in sorted(by_address.items()):
            try:
                reply = await self.door.scheduler(address).Lookup(scheduler_pb2.LookupRequest(
                    request_ids=[attempt for _, attempt in asked]), timeout=self.door.config.downstream_timeout_s)
            except grpc.aio.AioRpcError:
                continue  # unreachable or too old to answer: the probes and the router decide, as before
            live = set(reply.live)
            for completion in reply.recent:
                live.add(completion.request_id)
                self._fetched(completion)
                await self.door.on_completion(FROM_LOOKUP, completion.SerializeToString(), Context())
            for record, attempt in asked:
                # Only the attempt asked about: one that moved meanwhile is another attempt, unknown there.
                if (attempt not in live and record.attempt_id == attempt and record.completion is None
                        and not record.settling):
                    self.door.spawn(self.door.migrator.migrate(record, MigrationCause.UNKNOWN_AT_SCHEDULER))

    def _fetched(self, completion: events_pb2.Completion) -> None:
        """Remember a fetched completion that its request still waited for; the bus copy or the grace judges it."""
        door = self.door
        request_id = door.migrator.attempts.get(completion.request_id, completion.request_id)
        record = door.records.get(request_id)
        if (record is None or record.attempt_id != completion.request_id or record.completion is not None
                or completion.request_id in record.bus_completions):
            return  # its bus copy came first, or the request ended or moved on: the fetch supplied nothing
        log.info("request %s: its completion was fetched from its scheduler (%s) before its bus copy came",
                 _named(request_id, completion.request_id), common_pb2.RequestStatus.Name(completion.status))
        record.span.add_event("completion_fetched", attributes={"sluice.attempt_id": completion.request_id})
        for forgotten in self.fetches.fetched(completion.request_id, request_id, time.monotonic()):
            self._judged(forgotten)

    def on_bus_copy(self, completion: events_pb2.Completion, record: Tracked | None) -> None:
        """A completion came on the bus: noted on its request's `record` (None: not tracked); if it was fetched
        before, it was late."""
        if record is not None:
            record.bus_completions.add(completion.request_id)
        verdict = self.fetches.arrived(completion.request_id, time.monotonic())
        if verdict is not None:
            self._judged(verdict)

    def judge_overdue(self, now: float) -> None:
        """Judge lost the fetched completions whose bus copy has not come within the grace (`now`: monotonic)."""
        for verdict in self.fetches.overdue(now):
            self._judged(verdict)

    def _judged(self, verdict: FetchVerdict) -> None:
        self.door.metrics.completions_fetched.labels(verdict.outcome.value).inc()
        name = _named(verdict.request_id, verdict.attempt_id)
        if verdict.outcome is FetchOutcome.LOST:
            log.warning("request %s: its completion was lost on the bus (fetched from its scheduler %.1f s ago, "
                        "no bus copy since)", name, verdict.since_fetch_s)
        elif verdict.outcome is FetchOutcome.LATE:
            log.debug("request %s: the bus copy of its fetched completion came %.3f s after the fetch (late, not "
                      "lost)", name, verdict.since_fetch_s)
        else:
            log.info("request %s: its fetched completion was forgotten unjudged %.1f s after the fetch (more than "
                     "%d waited for their bus copy)", name, verdict.since_fetch_s, self.fetches.capacity)
        record = self.door.records.get(verdict.request_id)
        if record is not None and not record.ended:  # usually ended by the fetched completion itself
            record.span.add_event(f"completion_{verdict.outcome.value}", attributes={
                "sluice.attempt_id": verdict.attempt_id, "sluice.since_fetch_s": verdict.since_fetch_s})


def _named(request_id: str, attempt_id: str) -> str:
    return request_id if attempt_id == request_id else f"{request_id} (attempt {attempt_id})"
