"""Prefill/decode hand-offs: admission acts on the pair the router answers (docs/disaggregation.md, "Live mode").

Rules
-----
* A Route that answers a decode replica other than the prefill one (`RouteResponse.decode_replica_id`) makes the
  attempt a *prefill half*: it is submitted to the prefill replica with max_tokens 1 and `hold_kv` (its scheduler
  pins the prompt's full KV blocks when it ends FINISHED_LENGTH). Its first token streams to the client as any
  token does. A request with one token left needs no decode half and is submitted whole.
* Its FINISHED_LENGTH completion does not end the request: once the stream holds that token, the request moves
  to the pair's decode replica as a *planned migration attempt* (`Migrator._next_attempt`: `{id}#{n}`, the stream
  retargeted first, so a late token of the old attempt is dropped and no token is lost or repeated): the prompt
  plus the tokens streamed so far, max_tokens what is left, and `kv_source` naming the prefill replica, its
  scheduler and the prefill attempt. The decode scheduler pulls the blocks (or recomputes them) before queueing.
* Any other end of the prefill half (a stop token, a cancel, a failure) ends the request as usual. A second copy
  of the FINISHED_LENGTH completion (the bus delivers at least once; a Lookup fetches one) is the hand-off under
  way, never the request's end: `record.handoff` stays set until the attempt moves.
* The hand-off does not count against the migration limit (`Tracked.handoffs`); placing the request again after a
  refused decode half does (a decode side that keeps refusing ends it FAILED `migration_limit`, as re-routes do).
* The decode Submit failing (the decode replica died, refused, did not answer): the hold is released at the
  prefill side (best effort; its expiry ends it otherwise), the failed attempt is forgotten at the router, and
  the request is placed again through routing, as a migration places it (a new pair: the prompt and the tokens
  streamed so far are recomputed on its prefill replica). A refusal that says when to come back (RetryInfo: a
  decode scheduler whose Redis is away answers 1 s) is waited for, at most `migration.REFUSAL_PAUSE_MAX_S`, before that
  placement: placing at once would find the same decode side still refusing and spend the migration limit in a
  fraction of a second (the chaos run's FAILED `migration_limit` during 3 s Redis stalls). A Submit that reached
  no scheduler (`Migrator.unreached`: a decode scheduler restarting on its address) drops that channel and
  sends no Cancel there, so the next hand-off dials it afresh rather than meeting the old channel's reconnect
  backoff. A client cancel during
  the hand-off reaches the decode
  scheduler (the record points there before the Submit is sent), which stops the transfer and releases both
  sides; one that came before the move ends the request CANCELLED here.
* Span events on the request's root span: `kv_held` (the prefill half is done, its blocks wait), `handed_off`
  (the decode half submitted) or `handoff_failed`; metric `sluice_admission_kv_handoffs_total{outcome}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from admission_svc import convert
from admission_svc.calls import HandOff, Placement
from admission_svc.migration import (
    REROUTE_CODES,
    MigrationCause,
    one_move_at_a_time,
    refusal_pause_s,
)
from sluice import telemetry
from sluice.v1 import common_pb2, events_pb2, router_pb2, scheduler_pb2

if TYPE_CHECKING:
    from admission_svc.calls import GenerateCall, Tracked
    from admission_svc.frontdoor import FrontDoor

log = logging.getLogger(__name__)

__all__ = ["HandOffs", "is_prefill_done", "pair_of"]



def pair_of(record: Tracked, route: router_pb2.RouteResponse, max_tokens: int) -> HandOff | None:
    """Return the hand-off a route makes of the record's current attempt, or None (no transfer, or one token)."""
    if not route.decode_replica_id or route.decode_replica_id == route.replica_id or max_tokens <= 1:
        return None
    return HandOff(record.attempt_id, route.replica_id, route.scheduler_address, route.decode_replica_id,
                   route.decode_scheduler_address, route.decode_incarnation)


def is_prefill_done(record: Tracked, completion: events_pb2.Completion) -> bool:
    """True when `completion` ends the record's current prefill half by its length: the decode half follows."""
    pair = record.handoff
    return (pair is not None and record.completion is None and completion.status == common_pb2.FINISHED_LENGTH
            and completion.request_id == pair.prefill_attempt)


class HandOffs:
    """Moves prefill halves to their decode replicas (see the module docstring)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door

    async def hand_off(self, record: Tracked, completion: events_pb2.Completion) -> None:
        """Submit the decode half of `record` after its prefill half's `completion`."""
        await one_move_at_a_time(record, lambda: self._hand_off(record, completion))

    async def _hand_off(self, record: Tracked, completion: events_pb2.Completion) -> None:
        door, stream, pair = self.door, record.stream, record.handoff
        migrator = door.migrator
        assert pair is not None
        # `record.handoff` stays set while this waits: a copy of the prefill half's completion (the bus delivers at
        # least once, and a Lookup fetches one of a completion Redis held up) is then this hand-off again, which
        # one_move_at_a_time drops, and not the request's end (FINISHED_LENGTH after its first token).
        placement = await self._placement(record)
        arrived = placement is not None and await self._tokens_arrived(
            record, stream.offset + completion.usage.output_tokens)
        record.handoff = None  # from here the attempt moves, or the hand-off ends, before anything is awaited
        if placement is None or record.completion is not None or record.ended:
            # Its first Submit's reply never came back (FrontDoor._admit abandons it then), or the request ended
            # meanwhile: no decode half.
            self._release(pair, "failed")
            return
        if not arrived:
            self._release(pair, "failed")
            await migrator._move(record, MigrationCause.TOKEN_GAP)  # noqa: SLF001 (the one move, shared)
            return
        streamed = len(stream.tokens)
        record.span.add_event("kv_held", attributes={"sluice.prefill_replica_id": pair.prefill_replica_id,
                                                     "sluice.decode_replica_id": pair.decode_replica_id,
                                                     "sluice.tokens_kept": streamed})
        if record.timestamps.cancel_requested:  # the client cancelled while the prefill half ended
            self._release(pair, "cancelled")
            migrator.end_locally(record, common_pb2.CANCELLED, "cancelled before the decode half was submitted",
                                 finish_reason="cancelled")
            return
        call, ids = self._decode_half(record, placement.call, list(placement.prompt_ids), streamed)
        migrator._next_attempt(record, streamed, cancel_old=False)  # noqa: SLF001 (the prefill half has ended)
        record.handoffs += 1
        record.replica_id, record.scheduler_address = pair.decode_replica_id, pair.decode_address
        record.incarnation = pair.decode_incarnation
        submit = convert.submit_request(record.attempt_id, record.tenant, ids, call, door.owner,
                                        placement.deadline_unix_s or 0.0, door.model, record.timestamps,
                                        door.core.tenant_weight(record.tenant), door.core.cache_salt(record.tenant),
                                        door.config.stream_interval)
        submit.owner_incarnation = migrator.incarnation
        submit.kv_source.CopyFrom(scheduler_pb2.KvSource(replica_id=pair.prefill_replica_id,
                                                         scheduler_address=pair.prefill_address,
                                                         request_id=pair.prefill_attempt))
        metadata = tuple(telemetry.inject_metadata(trace.set_span_in_context(record.span)))
        sent = record.submit_sent_s = time.time()
        try:
            await door.scheduler(pair.decode_address).Submit(submit, metadata=metadata,
                                                             timeout=door.config.downstream_timeout_s)
        except grpc.aio.AioRpcError as exc:
            await self._decode_refused(record, pair, exc, call, ids)
            return
        door.metrics.handoffs.labels("submitted").inc()
        record.span.add_event("handed_off", attributes={"sluice.decode_replica_id": pair.decode_replica_id,
                                                        "sluice.attempt_id": record.attempt_id})
        door._submitted(record, sent)  # noqa: SLF001 (the stage any accepted Submit records)
        if record.timestamps.cancel_requested:  # the client cancelled while it was submitted
            door.spawn(door.cancel_downstream(record, "client"))

    async def _placement(self, record: Tracked) -> Placement | None:
        """Return how the record was placed, waiting for it: a short prompt's completion can come over Redis before
        its first Submit's reply, and the placement is recorded on that reply (at most the Submit's timeout)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.door.config.downstream_timeout_s + 1.0
        while record.placement is None and not record.ended and loop.time() < give_up:
            await asyncio.sleep(0.005)
        return record.placement

    async def _tokens_arrived(self, record: Tracked, count: int) -> bool:
        """Wait (at most the stream's grace) until the stream holds `count` tokens; return whether it does."""
        stream = record.stream
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.door.registry.grace_s
        while len(stream.tokens) < count and stream.gap_at is None and loop.time() < give_up:
            await stream.changed(give_up - loop.time())
        return len(stream.tokens) >= count

    @staticmethod
    def _decode_half(record: Tracked, call: GenerateCall, prompt: list[int],
                     streamed: int) -> tuple[GenerateCall, list[int]]:
        """Return the decode half's call (max_tokens what is left) and prompt (the prompt + the tokens streamed)."""
        sampling = dataclasses.replace(call.sampling, max_tokens=call.sampling.max_tokens - streamed)
        if sampling.json_schema:  # the grammar replays what was made under the schema before this attempt
            sampling = dataclasses.replace(sampling, json_prefix_ids=tuple(record.stream.tokens[:streamed]))
        return dataclasses.replace(call, sampling=sampling), prompt + record.stream.tokens[:streamed]

    async def _decode_refused(self, record: Tracked, pair: HandOff, exc: grpc.aio.AioRpcError, call: GenerateCall,
                              ids: list[int]) -> None:
        """The decode Submit failed: release the hold, forget the attempt, place the request again (a new pair)."""
        door, migrator = self.door, self.door.migrator
        door.metrics.handoffs.labels("failed").inc()
        record.span.add_event("handoff_failed", attributes={"sluice.decode_replica_id": pair.decode_replica_id,
                                                            "sluice.code": exc.code().name})
        log.warning("request %s: its decode half's Submit to %s failed (%s: %s); placing it again",
                    record.request_id, pair.decode_replica_id, exc.code().name, exc.details())
        self._release(pair, "failed")
        # Nothing reached it (a decode scheduler restarting on its address): its channel is dropped and nothing is
        # sent there to cancel, else the next hand-off to it met the channel's reconnect backoff and was refused at
        # once, three times in ~80 ms although the scheduler was back (`sluice_tools.chaos --disagg 1:1`: 36
        # streams ended FAILED migration_limit so).
        reached_none = migrator.unreached(pair.decode_address, exc)
        refused = record.attempt_id
        moves = record.migrations - record.handoffs
        if moves >= door.config.migration_limit:  # each refusal's new placement is a move, as a re-route is
            door.metrics.migration_failures.labels("migration_limit").inc()
            migrator.end_locally(record, common_pb2.FAILED, f"migration_limit: its decode half was refused at "
                                                            f"{pair.decode_replica_id} ({exc.code().name}) after "
                                                            f"{moves} migrations", lost=True)
            # After the end: the REJECTED completion of the current attempt would otherwise end it REJECTED.
            migrator.forget_attempt(record, refused, pair.decode_replica_id, f"hand-off: {exc.code().name}")
            return
        # The next attempt first, before anything is awaited (as Migrator.reroute): the REJECTED completion that
        # makes the router forget the refused attempt comes back to admission too, and must be another attempt's
        # by then; while the refused one was current it ended the request (REJECTED after its first token).
        migrator._next_attempt(record, len(record.stream.tokens), cancel_old=not reached_none)  # noqa: SLF001
        migrator.forget_attempt(record, refused, pair.decode_replica_id, f"hand-off: {exc.code().name}")
        if exc.code() in REROUTE_CODES:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await door.router.ReportUnreachable(router_pb2.ReportUnreachableRequest(
                    replica_id=pair.decode_replica_id, scheduler_address=pair.decode_address,
                    detail=f"{exc.code().name}: {exc.details()}"), timeout=door.config.downstream_timeout_s)
        pause = refusal_pause_s(exc)
        if pause and not record.timestamps.cancel_requested:
            await asyncio.sleep(pause)
        if record.completion is not None:  # it ended while this waited (its deadline): nothing to place
            return
        if record.timestamps.cancel_requested:
            migrator.end_locally(record, common_pb2.CANCELLED, "cancelled during the hand-off",
                                 finish_reason="cancelled")
            return
        placed = await migrator._place(record, call, ids, record.placement.deadline_unix_s  # noqa: SLF001
                                       if record.placement else None)
        if not placed and record.completion is None:  # not when it ended meanwhile (a cancel): no second end
            migrator.end_locally(record, common_pb2.FAILED, f"hand-off to {pair.decode_replica_id} failed and no "
                                                            f"replica took the request within "
                                                            f"{door.config.migration_retry_s} s", lost=True)

    def _release(self, pair: HandOff, reason: str) -> None:
        """Tell the prefill scheduler to unpin the hold (best effort, in the background)."""
        async def release() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.door.scheduler(pair.prefill_address).ReleaseKv(
                    scheduler_pb2.ReleaseKvRequest(request_id=pair.prefill_attempt, reason=reason), timeout=2.0)

        self.door.spawn(release())
