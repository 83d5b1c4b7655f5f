"""Admission moves a handed-off request to another attempt with its streamed tokens, and ends it at the limit."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import pytest
from admission_harness import OUTPUT, StandInReplica, run, settle

from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from sluice import client as sdk
from sluice.bus import Bus
from sluice.types import DRAIN_HANDOFF
from sluice.v1 import common_pb2, events_pb2, scheduler_pb2_grpc

NO_RETRY = sdk.RetryPolicy(max_attempts=1)


def test_a_handed_off_request_moves_with_its_tokens_until_the_migration_limit(tmp_path: Path, redis_url: str,
                                                                                namespace: str) -> None:
    """Each hand-off re-submits attempt `id#n` with the prompt plus the tokens streamed so far and max_tokens
    reduced by them; the client's indices continue; past migration_limit the request ends FAILED
    (migration_limit), its reservation released once and the moves counted. The fleet lost it, so its stream
    ends UNAVAILABLE with a retry delay (reason request_lost), not INTERNAL as a replica's own failure does."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.end_status, replica.end_detail = common_pb2.CANCELLED, DRAIN_HANDOFF
        indices: list[int] = []
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.SluiceError) as info:
                async for chunk in client.generate("hi", max_tokens=8):
                    indices.extend(range(chunk.index, chunk.index + len(chunk.token_ids)))
        assert "migration_limit" in info.value.message and "FAILED" in info.value.message
        assert isinstance(info.value, sdk.Unavailable) and info.value.retry_delay_s == 1.0
        assert any(getattr(d, "reason", "") == "request_lost" and d.metadata.get("request_status") == "FAILED"
                   for d in info.value.details)
        assert indices == [0, 1, 2]
        first, *moved = replica.submitted
        assert [s.request_id for s in moved] == [f"{first.request_id}#1", f"{first.request_id}#2"]
        assert [list(s.prompt_token_ids) for s in moved] == [
            [*first.prompt_token_ids, OUTPUT[0]], [*first.prompt_token_ids, OUTPUT[0], OUTPUT[0]]]
        assert [s.sampling.max_tokens for s in replica.submitted] == [8, 7, 6]
        assert await settle(lambda: door.core.stats(0).active == 0)
        assert door.core.released == 1
        assert door.metrics.migrations.labels("handed_off")._value.get() == 2
        assert door.metrics.migration_failures.labels("migration_limit")._value.get() == 1

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=2))


def test_a_replica_cancel_without_the_hand_off_detail_ends_the_request(tmp_path: Path, redis_url: str,
                                                                       namespace: str) -> None:
    """A CANCELLED completion that is not a drain's hand-off is the request's end: no move."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.end_status = common_pb2.CANCELLED
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.Cancelled):
                await client.generate_text("hi", max_tokens=5)
        assert len(replica.submitted) == 1
        assert door.metrics.migrations.labels("handed_off")._value.get() == 0

    run(tmp_path, redis_url, namespace, body)


def test_a_submit_to_a_dead_scheduler_is_routed_again_and_finishes(tmp_path: Path, redis_url: str, namespace: str,
                                                                   span_exporter) -> None:  # type: ignore[no-untyped-def]
    """The router names a scheduler whose port refuses connections: admission reports it (ReportUnreachable),
    publishes a REJECTED completion of the abandoned attempt for the router, routes attempt `id#1` again and
    the client gets every token; the re-route is counted and is a span event."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.publish_completion = bus.publish_completion
        replica.dead_routes = 1
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=5)
        assert generation.finish_reason == "length" and generation.usage.output_tokens == 5
        request_id = generation.request_id
        assert [s.request_id for s in replica.submitted] == [f"{request_id}#1"]
        assert [(r.replica_id, r.scheduler_address) for r in replica.reports] == [("r-dead", replica.dead_address)]
        assert door.metrics.reroutes.labels("UNAVAILABLE")._value.get() == 1
        entries = await bus.read_stream("completions", "0", count=100)
        rejected = [c for c in (events_pb2.Completion.FromString(p) for _, p, _ in entries)
                    if c.status == common_pb2.REJECTED]
        assert [(c.request_id, c.replica_id) for c in rejected] == [(request_id, "r-dead")]
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1
        root = next(s for s in span_exporter.get_finished_spans() if s.attributes.get("sluice.request_id") == request_id)
        rerouted = [e for e in root.events if e.name == "rerouted"]
        assert [e.attributes["sluice.from_replica_id"] for e in rerouted] == ["r-dead"]

    run(tmp_path, redis_url, namespace, body)


def test_re_routes_stop_at_the_migration_limit_and_the_request_is_refused_unavailable(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """With every route naming a dead scheduler, admission routes again migration_limit times, then refuses the
    request UNAVAILABLE and releases its reservation once; nothing reached a scheduler."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.dead_routes = 10
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.Unavailable):
                await client.generate_text("hi", max_tokens=5)
        assert len(replica.reports) == 2 and replica.dead_routes == 7 and not replica.submitted
        assert door.metrics.reroutes.labels("UNAVAILABLE")._value.get() == 2
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=2))


def test_a_scheduler_back_on_its_address_takes_the_next_submit_at_once(tmp_path: Path, redis_url: str,
                                                                       namespace: str) -> None:
    """After a Submit to a dead scheduler was re-routed, the scheduler comes back on its address: the next
    request routed there is submitted there (admission dials afresh instead of waiting out the failed
    connection's reconnect backoff), with no second re-route."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.dead_routes = 1
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            await client.generate_text("hi", max_tokens=2)
            revived = grpc.aio.server()
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(replica, revived)
            revived.add_insecure_port(replica.dead_address)
            await revived.start()
            try:
                replica.dead_routes = 1
                generation = await client.generate_text("hi", max_tokens=2)
            finally:
                await revived.stop(None)
        assert generation.request_id in [s.request_id for s in replica.submitted]
        assert len(replica.reports) == 1 and door.metrics.reroutes.labels("UNAVAILABLE")._value.get() == 1

    run(tmp_path, redis_url, namespace, body)


def test_a_refused_move_of_a_stream_under_way_waits_the_delay_the_refusal_named(tmp_path: Path, redis_url: str,
                                                                                namespace: str) -> None:
    """A stream with tokens out, handed off, whose new attempt is refused UNAVAILABLE with a retry delay (a
    scheduler whose Redis is away says 1 s), is routed again after that delay, not at once (which met the same
    refusal and spent the migration limit in milliseconds): two refusals naming 0.4 s, then the stream goes on
    after its token and gets all five, the three Submits of the move spaced by the delay."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.end_status, replica.end_detail = common_pb2.CANCELLED, DRAIN_HANDOFF
        replica.end_first_attempts_only = True
        replica.refused_submits, replica.refusal_retry_after_s = 0, 0.4
        first_token = asyncio.Event()

        async def refuse_the_move() -> None:
            await first_token.wait()
            replica.refused_submits = 2

        refusing = asyncio.create_task(refuse_the_move())
        tokens: list[int] = []
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            async for chunk in client.generate("hi", max_tokens=5):
                tokens.extend(chunk.token_ids)
                first_token.set()
        await refusing
        assert tokens == [OUTPUT[0], *OUTPUT[:4]]  # the stand-in starts its output again for the moved attempt
        assert [s.sampling.max_tokens for s in replica.submitted] == [5, 4, 4, 4]
        moves = replica.submit_times[1:]
        assert len(moves) == 3
        assert all(later - earlier >= 0.35 for earlier, later in itertools.pairwise(moves)), moves
        assert door.metrics.reroutes.labels("UNAVAILABLE")._value.get() == 2

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=4))


def test_a_refused_first_attempt_is_routed_again_at_once(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A request with no token out yet, refused with a retry delay, is routed again at once (its client can still
    retry, so it is answered fast): two refusals naming 1 s, then it finishes, the Submits well under 1 s apart."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.refused_submits, replica.refusal_retry_after_s = 2, 1.0
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            answer = await client.generate_text("hi", max_tokens=5)
        assert answer.text == bytes(OUTPUT[:5]).decode() and answer.status == "FINISHED_LENGTH"
        times = replica.submit_times
        assert len(times) == 3 and times[-1] - times[0] < 0.5, times

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=3))
