"""Admission's prefill/decode hand-off against a stand-in pair (admission_svc/handoff.py): a request ends once."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from admission_harness import OUTPUT, StandInReplica, run, settle

from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from sluice import client as sdk
from sluice.bus import Bus
from sluice.v1 import scheduler_pb2_grpc

NO_RETRY = sdk.RetryPolicy(max_attempts=1)


def test_a_second_copy_of_the_prefill_completion_does_not_end_the_request(tmp_path: Path, redis_url: str,
                                                                          namespace: str) -> None:
    """The prefill half's FINISHED_LENGTH completion arrives twice while its hand-off waits for the first Submit's
    reply (a Lookup's copy of a completion Redis held up, then the bus's own: found by `sluice_tools.chaos --disagg
    1:1`, where the client got FINISHED_LENGTH after 1 of 64 tokens): the copy is the hand-off already under way, not
    the request's end, so the client gets every token, and the decode half is submitted once."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.pair, replica.prefill_completion_copies, replica.submit_reply_delay_s = True, 2, 0.3
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=5)
        assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 5)
        request_id = generation.request_id
        prefill, *decode = replica.submitted
        assert (prefill.request_id, prefill.hold_kv, prefill.sampling.max_tokens) == (request_id, True, 1)
        assert [(s.request_id, s.kv_source.request_id, s.sampling.max_tokens) for s in decode] == [
            (f"{request_id}#1", request_id, 4)]
        assert list(decode[0].prompt_token_ids) == [*prefill.prompt_token_ids, OUTPUT[0]]
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1

    run(tmp_path, redis_url, namespace, body)


def test_a_refused_decode_half_is_placed_again_even_when_the_routers_answer_is_slow(tmp_path: Path, redis_url: str,
                                                                                   namespace: str) -> None:
    """The decode half's Submit is refused UNAVAILABLE and the router's ReportUnreachable answers late: the REJECTED
    completion that tells the router to forget the refused attempt lands meanwhile, and is that attempt's, not the
    request's end (found by `sluice_tools.chaos --disagg 2:2`: such requests ended at once, REJECTED, instead of
    being placed again): the request is placed again (a new pair) and the client gets every token."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.publish_completion = bus.publish_completion
        replica.pair, replica.refused_decode_halves, replica.report_delay_s = True, 1, 0.3
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=5)
        assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 5)
        request_id = generation.request_id
        assert [(s.request_id, s.hold_kv, s.HasField("kv_source")) for s in replica.submitted] == [
            (request_id, True, False), (f"{request_id}#1", False, True),  # refused
            (f"{request_id}#2", True, False), (f"{request_id}#3", False, True)]
        assert [r.replica_id for r in replica.reports] == ["r1"]
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1

    run(tmp_path, redis_url, namespace, body)


def test_decode_halves_refused_again_and_again_end_the_request_at_the_migration_limit(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """Each refused decode half places the request again (a new prefill half recomputing the prompt), and each such
    move counts against migration_limit as a re-route does: past it the request ends FAILED (migration_limit)
    instead of cycling prefill, refusal, prefill for as long as the decode side refuses (found by
    `sluice_tools.chaos --disagg 1:1`: up to 20 cycles of one request while the decode scheduler had lost Redis)."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.publish_completion = bus.publish_completion
        replica.pair, replica.refused_decode_halves = True, 10
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.SluiceError) as info:
                await client.generate_text("hi", max_tokens=5)
        assert "migration_limit" in info.value.message and "FAILED" in info.value.message
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.retry_delay_s == 1.0  # lost, not a bug
        first = replica.submitted[0].request_id
        assert [(s.request_id, s.HasField("kv_source")) for s in replica.submitted] == [
            (first, False), (f"{first}#1", True), (f"{first}#2", False), (f"{first}#3", True),
            (f"{first}#4", False), (f"{first}#5", True)]
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1
        assert door.metrics.migration_failures.labels("migration_limit")._value.get() == 1

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=2))


def test_a_decode_half_refused_with_a_retry_delay_is_placed_again_after_that_delay(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A decode side that refuses UNAVAILABLE naming a retry delay (a scheduler whose Redis is away says 1 s) is given
    that delay before the request is placed again, so a short outage does not spend the migration limit in a
    fraction of a second (the chaos run's FAILED `migration_limit` during 3 s Redis stalls); the request then
    completes with every token."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.publish_completion = bus.publish_completion
        replica.pair, replica.refused_decode_halves, replica.refusal_retry_after_s = True, 2, 0.4
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=5)
        assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 5)
        first = generation.request_id
        at = replica.submitted_at
        assert at[f"{first}#2"] - at[f"{first}#1"] >= 0.4 and at[f"{first}#4"] - at[f"{first}#3"] >= 0.4
        assert f"{first}#5" in at and await settle(lambda: door.core.stats(0).active == 0)

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=2))


def test_a_decode_scheduler_back_on_its_address_takes_the_next_decode_half_at_once(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """The pair's decode scheduler is down when the hand-off comes (connection refused) and back on the same address
    by the time the request is placed again: the next decode half reaches it (admission drops the channel that could
    not connect instead of failing at once in its reconnect backoff), so the request completes with every token
    within a migration limit of 1 (found by `sluice_tools.chaos --disagg 1:1`: 36 streams ended FAILED
    migration_limit, each refused three times in ~80 ms by a decode scheduler the router had seen registered)."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.publish_completion = bus.publish_completion
        revived = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(replica, revived)

        async def revive() -> None:  # bound only now: a port bound before would hang the first Submit, not refuse it
            if not replica.reports[1:]:
                revived.add_insecure_port(replica.dead_address)
                await revived.start()

        replica.pair, replica.decode_address, replica.on_report = True, replica.dead_address, revive
        try:
            async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
                generation = await client.generate_text("hi", max_tokens=5)
        finally:
            await revived.stop(None)
        assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 5)
        first = generation.request_id
        assert [(s.request_id, s.HasField("kv_source")) for s in replica.submitted] == [
            (first, False), (f"{first}#2", False), (f"{first}#3", True)]  # #1 never reached a scheduler
        at = replica.submitted_at
        assert at[f"{first}#3"] - at[first] < 2.0, "the move did not wait for a timeout or a backoff"
        assert [r.scheduler_address for r in replica.reports] == [replica.dead_address]
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=1))
