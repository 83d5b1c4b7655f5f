"""Migration: a request whose replica goes away moves to another, with no token lost or repeated.

Rules
-----
* Admission owns each request's fate until its terminal status; the loss of its replica is not one.
* Causes (`MigrationCause`):
  HANDED_OFF      the replica ended it CANCELLED with detail DRAIN_HANDOFF (sluice.types): a drain
                  past its timeout hands what is left to migration (scheduler_svc ReplicaAgent.drain).
  REPLICA_GONE    it stalled and the router no longer lists its replica (heartbeats lost, retired).
  SCHEDULER_GONE  it stalled and its scheduler refuses a health check (UNAVAILABLE: process dead).
  WORKER_DOWN     it stalled and the router says its replica is UNHEALTHY (the worker is down, or a
                  ReportUnreachable took it out while its scheduler still answers).
  REPLICA_RESTARTED it stalled and the router lists its replica under another scheduler incarnation
                  than the one it was routed to: the scheduler restarted (on the same address, so its
                  health answers) and what the old process held is gone.
  TOKEN_GAP       its token stream broke off: deltas were lost on the bus (a Redis restart loses what was
                  not read yet), mid-stream or at its end (a completion counting tokens that never came
                  within the stream's grace). The move recomputes from the last exact token; no token
                  the model did not produce is ever streamed (admission_svc/streams.py).
  UNKNOWN_AT_SCHEDULER it stalled, its replica is healthy, and its scheduler (asked with Lookup) neither
                  holds it nor remembers its completion.
  A stalled request that its scheduler ended recently gets the completion from the Lookup reply, as if it
  had come from the bus (a Redis restart loses the entries nobody had read yet); whether that completion was
  lost on the bus or only late is judged afterwards (admission_svc/lookups.py).
  "Stalled" is no new token for `stall_timeout_s`; a request queued behind others on a healthy replica
  stalls too, and stays, because its replica is listed, healthy and answering.
* A move submits a new *attempt* `{request_id}#{n}`: the prompt is the original prompt plus the tokens
  streamed so far (recomputed on the new replica), max_tokens what is left. The stream is retargeted
  before anything is awaited, so a late token of the old attempt is dropped and the new attempt's
  token 0 is output index `streamed`; the old attempt is cancelled at its scheduler, best effort.
* Re-routing: a Submit that cannot reach its scheduler (UNAVAILABLE: refused connection, or a refusal
  such as draining; DEADLINE_EXCEEDED: no answer) is placed again (`Migrator.reroute`), as a new attempt: at
  once, or, for a stream with tokens out, after the retry delay a refusal named (at most
  `REFUSAL_PAUSE_MAX_S`): the router is told
  (ReportUnreachable: it probes and takes a dead scheduler out of routing, instead of routing to it until
  its heartbeats time out), the abandoned attempt gets a REJECTED
  completion (the router forgets it) and a best-effort Cancel, and the request is routed again. This
  covers the ~10 s after a scheduler dies, before the router drops it; metric
  `sluice_admission_reroutes_total{code}`, span event "rerouted".
* Placing a moved request again after no replica took it backs off from 0.1 s (doubling, at most 1 s), and
  waits longer when the refusal said when to come back (RetryInfo, at most `REFUSAL_PAUSE_MAX_S`): a
  scheduler whose Redis is away answers 1 s, and asking again sooner only spends the retry window.
* A request moves (migrations and re-routes together) at most `migration_limit` times; one more loss
  ends it FAILED (`migration_limit`) or, not yet placed, refuses it with the Submit's status,
  as does not finding a replica within `migration_retry_s`, or a stream with a token gap (nothing
  exact to recompute from). Every end goes through FrontDoor.complete, which releases the reservation
  exactly once.

`decide` is the watchdog's rule, pure: the stalled requests and what the router and the probes say in,
(request id, cause) pairs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice import errors
from sluice.prom import zero_series
from sluice.types import ATTEMPT_SEPARATOR, DRAIN_HANDOFF
from sluice.v1 import common_pb2, events_pb2, router_pb2, scheduler_pb2

if TYPE_CHECKING:
    from admission_svc.calls import Tracked
    from admission_svc.frontdoor import FrontDoor
    from admission_svc.streams import RequestStream

log = logging.getLogger(__name__)

__all__ = ["REFUSAL_PAUSE_MAX_S", "REROUTE_CODES", "Listed", "MigrationCause", "Migrator", "Stalled", "attempt_id",
           "decide", "refusal_pause_s"]

REFUSAL_PAUSE_MAX_S = 2.0
"""The longest wait for the retry delay a refusal named (RetryInfo) before placing a moved request again."""


def refusal_pause_s(exc: grpc.aio.AioRpcError) -> float:
    """The wait a refused call asks for before the next try: its RetryInfo, at most `REFUSAL_PAUSE_MAX_S`; 0 for
    none (a connection refused, or a refusal that names no delay)."""
    return min(errors.details_of(exc).retry_after_s or 0.0, REFUSAL_PAUSE_MAX_S)


def unconnected(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call to a scheduler reached none: UNAVAILABLE without the scheduler's own status details
    (connection refused, or the channel still backing off from an earlier refusal); `Migrator.unreached` then drops
    its channel."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and not exc.trailing_metadata()


REROUTE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Submit failures after which admission routes the request again: the scheduler did not take it
(UNAVAILABLE) or did not answer (DEADLINE_EXCEEDED; if it took it after all, the old attempt is cancelled
there and its late tokens are dropped, since the new attempt has a new id)."""


class MigrationCause(enum.Enum):
    """Why a request moves (the `cause` label of the migration metric and span event)."""

    HANDED_OFF = "handed_off"
    REPLICA_GONE = "replica_gone"
    WORKER_DOWN = "worker_down"
    SCHEDULER_GONE = "scheduler_gone"
    REPLICA_RESTARTED = "replica_restarted"
    TOKEN_GAP = "token_gap"
    UNKNOWN_AT_SCHEDULER = "unknown_at_scheduler"


@dataclass(frozen=True)
class Stalled:
    """A placed, live request with no new token for at least the stall timeout."""

    request_id: str
    replica_id: str
    scheduler_address: str
    incarnation: str = ""
    """The scheduler incarnation it was routed to ("" = not reported: not compared)."""


@dataclass(frozen=True)
class Listed:
    """What the router's listing says of one replica."""

    state: int
    """router_pb2.ReplicaState."""
    incarnation: str = ""


def attempt_id(request_id: str, migrations: int) -> str:
    """Return the downstream id of a request's attempt after `migrations` moves (the first: the id itself)."""
    return request_id if migrations == 0 else f"{request_id}{ATTEMPT_SEPARATOR}{migrations}"


def decide(stalled: Iterable[Stalled], replica_states: Mapping[str, Listed] | None,
           scheduler_up: Mapping[str, bool]) -> list[tuple[str, MigrationCause]]:
    """Return the stalled requests to move and why.

    `replica_states`: the router's listing (replica id -> state and incarnation), None when the
    router did not answer (then only the probes decide). `scheduler_up`: health probe per address; a
    failed probe names the cause SCHEDULER_GONE even when a report made the replica UNHEALTHY.
    """
    moves = []
    gone = Listed(router_pb2.GONE)
    for request in stalled:
        listed = None if replica_states is None else replica_states.get(request.replica_id, gone)
        state = None if listed is None else listed.state
        if state == router_pb2.GONE:
            moves.append((request.request_id, MigrationCause.REPLICA_GONE))
        elif (listed is not None and listed.incarnation and request.incarnation
              and listed.incarnation != request.incarnation):
            moves.append((request.request_id, MigrationCause.REPLICA_RESTARTED))
        elif not scheduler_up.get(request.scheduler_address, True):
            moves.append((request.request_id, MigrationCause.SCHEDULER_GONE))
        elif state == router_pb2.UNHEALTHY:
            moves.append((request.request_id, MigrationCause.WORKER_DOWN))
    return moves


def handed_off(record: Tracked, completion: events_pb2.Completion) -> bool:
    """True when a draining replica handed the request over (and admission did not ask to cancel it)."""
    return (completion.status == common_pb2.CANCELLED and completion.detail == DRAIN_HANDOFF
            and not record.timestamps.cancel_requested)


async def one_move_at_a_time(record: Tracked, move: Callable[[], Awaitable[None]]) -> None:
    """Run `move` (a migration or a hand-off of `record`) unless one is under way or the request has ended;
    `record.migrating` says one is under way while it runs."""
    if record.migrating or record.completion is not None or record.ended:
        return
    record.migrating = True
    try:
        await move()
    finally:
        record.migrating = False


class Migrator:
    """The front door's watchdog and mover (see the module docstring)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.attempts: dict[str, str] = {}
        """Attempt id -> request id, for every attempt after the first."""
        door.registry.on_gap = self.on_gap
        # Every cause and re-route code exported at 0 from the start (sluice.prom.zero_series).
        zero_series(door.metrics.migrations, (cause.value for cause in MigrationCause))
        zero_series(door.metrics.reroutes, sorted(code.name for code in REROUTE_CODES))
        self.incarnation = uuid.uuid4().hex[:16]
        """This admission process's incarnation: its requests' owner leases at the schedulers name it."""
        self._renewing: asyncio.Future[None] | None = None

    # ---- token gaps -----------------------------------------------------------------------------
    def on_gap(self, stream: RequestStream) -> None:
        """A request's stream broke off (deltas lost): move it, recomputing from its last exact token."""
        record = self.door.records.get(stream.request_id)
        if record is not None and not record.migrating and record.completion is None:
            self.door.spawn(self.migrate(record, MigrationCause.TOKEN_GAP))

    def held(self, record: Tracked, completion: events_pb2.Completion) -> bool:
        """True when a successful completion counts tokens the stream does not hold yet: it is held back (the
        request stays open) while `settle` waits for them. Completions can overtake their last deltas."""
        finished = completion.status in (common_pb2.FINISHED_STOP, common_pb2.FINISHED_LENGTH)
        if not finished or len(record.stream.tokens) >= completion.usage.output_tokens:
            return False
        if not record.settling:
            record.settling = True
            self.door.spawn(self.settle(record, completion))
        return True

    async def settle(self, record: Tracked, completion: events_pb2.Completion) -> None:
        """Complete the request once its stream holds every token the completion counts; when they do not come
        within the stream's grace (lost on the bus), move it from its last exact token instead (TOKEN_GAP)."""
        stream, attempt = record.stream, record.attempt_id
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.door.registry.grace_s
        try:
            while (len(stream.tokens) < completion.usage.output_tokens and stream.gap_at is None
                   and loop.time() < give_up and record.attempt_id == attempt):
                await stream.changed(give_up - loop.time())
        finally:
            record.settling = False
        if record.attempt_id != attempt or record.completion is not None:
            return  # moved or ended meanwhile
        if len(stream.tokens) >= completion.usage.output_tokens:
            self.door.complete(record.request_id, record, completion)
            return
        log.warning("request %s: its completion counts %d tokens, %d arrived: moving it from the last exact token",
                    record.request_id, completion.usage.output_tokens, len(stream.tokens))
        await self.migrate(record, MigrationCause.TOKEN_GAP)

    # ---- the watchdog ---------------------------------------------------------------------------
    async def watch(self, stop: asyncio.Event) -> None:
        """Check stalled requests every `watch_interval_s` until `stop`; errors are logged, not fatal. The owner
        leases are renewed on a clock of their own (`keep_leases`): a tick can wait up to the downstream timeout
        on a stalled router or scheduler, longer than a lease."""
        interval = self.door.config.watch_interval_s
        keeping = asyncio.create_task(self.keep_leases(stop))
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
                try:
                    await self.tick()
                except Exception:
                    log.exception("migration watchdog tick failed")
                self.door.publish_budgets()
        finally:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping

    async def keep_leases(self, stop: asyncio.Event) -> None:
        """Start a renewal every `watch_interval_s` until `stop`, unless the previous one is still waiting (a slow
        scheduler is given until its timeout, half a lease)."""
        interval = self.door.config.watch_interval_s
        while not stop.is_set():
            if self._renewing is None or self._renewing.done():
                self._renewing = asyncio.ensure_future(self._renew_logged())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def _renew_logged(self) -> None:
        try:
            await self.renew_leases()
        except Exception:
            log.exception("renewing the owner leases failed")

    async def renew_leases(self) -> None:
        """Renew this process's lease at every scheduler that holds one of its live requests (at once, in
        parallel, each given half a lease to answer; a failure is left to the next renewal: the lease outlasts
        several)."""
        addresses = sorted({r.scheduler_address for r in self.door.records.values()
                            if r.completion is None and not r.ended and r.scheduler_address})
        if not addresses:
            return
        request = scheduler_pb2.RenewLeaseRequest(owner=self.door.owner, owner_incarnation=self.incarnation,
                                                  ttl_s=self.door.config.owner_lease_s)
        timeout = self.door.config.owner_lease_s / 2
        replies = await asyncio.gather(*(self.door.scheduler(a).RenewLease(request, timeout=timeout)
                                         for a in addresses), return_exceptions=True)
        for address, reply in zip(addresses, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError):
                log.info("renewing the owner lease at %s failed (%s)", address, reply.code().name)
                self.unreached(address, reply)  # a restarted scheduler: the next renewal dials it afresh
            elif isinstance(reply, BaseException):
                raise reply

    def stalled(self, now: float) -> list[Stalled]:
        """Return the placed, live requests without a new token for `stall_timeout_s`."""
        limit = now - self.door.config.stall_timeout_s
        return [Stalled(r.request_id, r.replica_id, r.scheduler_address, r.incarnation)
                for r in self.door.records.values()
                if r.completion is None and not r.ended and not r.migrating and not r.settling
                and r.placement is not None
                and r.scheduler_address and r.stream.progress_at <= limit]

    async def tick(self) -> None:
        """Find the stalled requests whose replica is lost, and broken streams not moving yet (a break while a
        move was under way), and start their moves; look up the other stalled ones at their schedulers, and
        judge lost the completions fetched earlier whose bus copy has not come within the grace."""
        for broken in list(self.door.records.values()):
            if (broken.stream.gap_at is not None and broken.completion is None and not broken.migrating
                    and not broken.settling):
                self.door.spawn(self.migrate(broken, MigrationCause.TOKEN_GAP))
        self.door.lookups.judge_overdue(time.monotonic())
        stalled = self.stalled(time.monotonic())
        if not stalled:
            return
        states = await self._replica_states()
        probes = {}
        for address in sorted({s.scheduler_address for s in stalled}):
            probes[address] = await self._probe(address)
        moving = decide(stalled, states, probes)
        for request_id, cause in moving:
            record = self.door.records.get(request_id)
            if record is not None:
                self.door.spawn(self.migrate(record, cause))
        moved = {request_id for request_id, _ in moving}
        await self.door.lookups.look_up([s for s in stalled
                                         if s.request_id not in moved and probes.get(s.scheduler_address)])

    async def _replica_states(self) -> dict[str, Listed] | None:
        try:
            listed = await self.door.router.ListReplicas(router_pb2.ListReplicasRequest(),
                                                         timeout=self.door.config.downstream_timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return {r.replica_id: Listed(r.state, r.incarnation) for r in listed.replicas}

    async def _probe(self, address: str) -> bool:
        channel = self.door.scheduler_channel(address)
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            # Only a refused connection is a dead process; a slow answer (a busy or stopped one) is left
            # to the router's heartbeat timeout, so that load alone never moves a request.
            self.unreached(address, exc)  # a scheduler restarted on this address is dialled afresh by the next call
            return exc.code() != grpc.StatusCode.UNAVAILABLE
        return True

    def unreached(self, address: str, exc: grpc.aio.AioRpcError) -> bool:
        """Whether a failed call to the scheduler at `address` reached none (`unconnected`); if so its channel is
        dropped, so that a scheduler back on that address is dialled afresh by the next call, not after gRPC's
        reconnect backoff."""
        if not unconnected(exc):
            return False
        self.door.forget_scheduler(address)
        return True

    # ---- the move -------------------------------------------------------------------------------
    async def migrate(self, record: Tracked, cause: MigrationCause) -> None:
        """Move the request to another replica, or end it FAILED when it may not or cannot move."""
        await one_move_at_a_time(record, lambda: self._move(record, cause))

    async def _move(self, record: Tracked, cause: MigrationCause) -> None:
        door, stream, placement = self.door, record.stream, record.placement
        streamed = len(stream.tokens)
        if placement is None:
            self.end_locally(record, common_pb2.FAILED, f"replica lost ({cause.value}) before it was placed",
                              lost=True)
            return
        if record.migrations - record.handoffs >= door.config.migration_limit:
            door.metrics.migration_failures.labels("migration_limit").inc()
            self.end_locally(record, common_pb2.FAILED, f"migration_limit: replica lost ({cause.value}) after "
                                                        f"{record.migrations - record.handoffs} migrations", lost=True)
            return
        sampling = placement.call.sampling
        left = sampling.max_tokens - streamed
        if left <= 0:
            self.end_locally(record, common_pb2.FINISHED_LENGTH, "", finish_reason="length")
            return
        old_replica = record.replica_id
        self._next_attempt(record, streamed)
        door.metrics.migrations.labels(cause.value).inc()
        record.span.add_event("migrated", attributes={
            "cause": cause.value, "sluice.from_replica_id": old_replica, "sluice.tokens_kept": streamed,
            "sluice.migration": record.migrations})
        sampling = dataclasses.replace(sampling, max_tokens=left)
        if sampling.json_schema:  # the grammar replays what was made under the schema before this attempt
            sampling = dataclasses.replace(sampling, json_prefix_ids=tuple(stream.tokens[:streamed]))
        call = dataclasses.replace(placement.call, sampling=sampling)
        ids = list(placement.prompt_ids) + stream.tokens[:streamed]
        if not await self._place(record, call, ids, placement.deadline_unix_s):
            door.metrics.migration_failures.labels("no_replica").inc()
            self.end_locally(record, common_pb2.FAILED, f"replica lost ({cause.value}) and no replica took the "
                                                        f"request within {door.config.migration_retry_s} s", lost=True)
            return
        log.info("request %s migrated (%s) %s -> %s after %d tokens", record.request_id, cause.value, old_replica,
                 record.replica_id, streamed)
        if record.timestamps.cancel_requested:  # the client cancelled while it moved
            door.spawn(door.cancel_downstream(record, "client"))

    async def _place(self, record: Tracked, call: object, ids: list[int], deadline_unix_s: float | None) -> bool:
        """Route and submit the new attempt, retrying while no replica takes it; returns whether one did."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.door.config.migration_retry_s
        pause = 0.1
        while True:
            try:
                await self.door.route_and_submit(record, call, ids, deadline_unix_s)  # type: ignore[arg-type]
                return True
            except grpc.aio.AioRpcError as exc:
                asked = refusal_pause_s(exc)
                log.info("request %s: placing its migration failed (%s, retry in %.1f s); retrying",
                         record.request_id, exc.code().name, asked)
            wait = max(pause, asked)
            if loop.time() + wait > give_up or record.completion is not None:
                return False
            await asyncio.sleep(wait)
            pause = min(pause * 2, 1.0)

    def _next_attempt(self, record: Tracked, offset: int, cancel_old: bool = True) -> None:
        """Make `{request_id}#{n}` the record's current attempt, its token 0 at output index `offset`; cancel
        the old attempt at its scheduler (best effort, in the background) unless `cancel_old` is False."""
        old_address, old_attempt = record.scheduler_address, record.attempt_id
        record.migrations += 1
        new_attempt = attempt_id(record.request_id, record.migrations)
        self.attempts[new_attempt] = record.request_id
        # Retargeted before anything is awaited: a late token of the old attempt is dropped from here on.
        self.door.registry.retarget(record.stream, new_attempt, offset)
        record.attempt_id = new_attempt
        if cancel_old:
            self.door.spawn(self._cancel_old(old_address, old_attempt))

    # ---- re-routing an unreachable Submit -------------------------------------------------------
    async def reroute(self, record: Tracked, exc: grpc.aio.AioRpcError) -> bool:
        """After the record's Submit failed with `exc`: when the scheduler was unreachable and the request
        may move again, report it to the router and switch to a new attempt; returns whether to route again."""
        door = self.door
        if (exc.code() not in REROUTE_CODES or record.migrations - record.handoffs >= door.config.migration_limit
                or record.completion is not None):
            return False
        replica_id, address, old_attempt = record.replica_id, record.scheduler_address, record.attempt_id
        # A Submit that reached no scheduler left nothing there to cancel (and its channel is dropped).
        reached_none = self.unreached(address, exc)
        self._next_attempt(record, record.stream.offset, cancel_old=not reached_none)
        self.forget_attempt(record, old_attempt, replica_id, f"rerouted: Submit {exc.code().name}")
        door.metrics.reroutes.labels(exc.code().name).inc()
        record.span.add_event("rerouted", attributes={
            "sluice.from_replica_id": replica_id, "sluice.code": exc.code().name,
            "sluice.migration": record.migrations})
        log.info("request %s: Submit to %s at %s failed (%s: %s); routing it again", record.request_id,
                 replica_id, address, exc.code().name, exc.details())
        with contextlib.suppress(grpc.aio.AioRpcError):
            await door.router.ReportUnreachable(router_pb2.ReportUnreachableRequest(
                replica_id=replica_id, scheduler_address=address, detail=f"{exc.code().name}: {exc.details()}"),
                timeout=door.config.downstream_timeout_s)
        asked = refusal_pause_s(exc)
        if asked and record.stream.tokens and not record.timestamps.cancel_requested:
            # A stream under way, refused by a scheduler that said when to come back (draining 0.1 s, its worker
            # down 0.5 s, its Redis away 1 s): until the router stops listing it, routing again at once meets the
            # same refusal and spends the migration limit in milliseconds, ending a stream the client cannot
            # resume by retrying. A request with no token out yet is routed again at once and, at the limit,
            # refused fast with the retry delay (its client retries; docs/operations.md, "Redis down").
            await asyncio.sleep(asked)
        return record.completion is None  # it may have ended meanwhile (its deadline)

    def forget_attempt(self, record: Tracked, attempt: str, replica_id: str, detail: str) -> None:
        """Publish a REJECTED completion of an attempt that was routed but never placed, so that the router
        stops counting it on `replica_id` (admission's own handler ignores it: not the current attempt)."""
        if self.door.publish_completion is None:
            return
        self.door.spawn(self.door.publish_completion(events_pb2.Completion(
            request_id=attempt, tenant=record.tenant, status=common_pb2.REJECTED, finish_reason="rejected",
            detail=detail, owner=self.door.owner, replica_id=replica_id)))

    async def _cancel_old(self, address: str, old_attempt: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.door.scheduler(address).Cancel(scheduler_pb2.CancelRequest(request_id=old_attempt),
                                                      timeout=1.0)

    async def end_unknown(self, record: Tracked, attempt: str, cause: str) -> None:
        """The scheduler answered a Cancel of `attempt` NOT_FOUND: it finished the request (its completion is
        on the way) or no longer knows it (restarted). Wait the stream's grace for a completion, then end the
        request CANCELLED here, so that its reservation is released and its record closed (once: `complete`)."""
        await asyncio.sleep(self.door.registry.grace_s)
        if record.completion is not None or record.migrating or record.attempt_id != attempt:
            return
        record.span.add_event("unknown_at_scheduler", attributes={"sluice.attempt_id": attempt})
        self.end_locally(record, common_pb2.CANCELLED, f"cancelled ({cause}); replica {record.replica_id} no "
                                                       f"longer knows attempt {attempt}", finish_reason="cancelled")

    def end_locally(self, record: Tracked, status: common_pb2.RequestStatus, detail: str,
                    finish_reason: str = "error", lost: bool = False) -> None:
        """End a request admission gives up on (a lost replica it may not or cannot leave) with `status`;
        the reservation is released through FrontDoor.complete, as for any completion. `lost`: it failed because
        the fleet lost it (`Tracked.lost`: its stream ends UNAVAILABLE)."""
        record.lost = lost
        completion = events_pb2.Completion(
            request_id=record.request_id, tenant=record.tenant, replica_id=record.replica_id, status=status,
            finish_reason=finish_reason, detail=detail, owner=self.door.owner,
            usage=common_pb2.Usage(input_tokens=record.input_tokens, output_tokens=len(record.stream.tokens)))
        completion.timestamps.CopyFrom(record.timestamps)
        completion.timestamps.finished = time.time()
        log.warning("request %s ended %s: %s", record.request_id, common_pb2.RequestStatus.Name(status), detail)
        self.door.complete(record.request_id, record, completion)

    def whole(self, record: Tracked, completion: events_pb2.Completion) -> events_pb2.Completion:
        """Return the attempt's completion as the request's: its id, its input, every output token counted."""
        if record.stream.offset == 0 and completion.request_id == record.request_id:
            return completion
        whole = events_pb2.Completion()
        whole.CopyFrom(completion)
        whole.request_id = record.request_id
        whole.usage.input_tokens = record.input_tokens
        whole.usage.output_tokens = record.stream.offset + completion.usage.output_tokens
        return whole
