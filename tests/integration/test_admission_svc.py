"""The admission service over real gRPC and a real Redis, with stand-in router and scheduler servers.

The router and scheduler here are small real gRPC servers that publish tokens and completions
on the real bus the way a replica does; the component under test is admission (and its client).
The harness is in admission_harness.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from admission_harness import OUTPUT, OWNER, StandInReplica, run
from admission_harness import settle as _settle

from admission_svc.calls import FrontDoorConfig
from admission_svc.frontdoor import FrontDoor
from admission_svc.streams import RequestStream
from sluice import client as sdk
from sluice.bus import Bus
from sluice.tokenizer import build_byte_tokenizer
from sluice.v1 import common_pb2, events_pb2

pytestmark = pytest.mark.redis


def test_stream_text_usage_and_release(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A generation streams its tokens in order as text, ends with usage, and releases its reservation."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            result = await client.generate_text("hi there", max_tokens=5)
        assert (result.text, result.token_ids) == ("hello", tuple(OUTPUT[:5]))
        assert result.status == "FINISHED_LENGTH" and result.usage.output_tokens == 5
        assert replica.submitted[0].owner == OWNER and replica.submitted[0].tenant == "acme"
        assert await _settle(lambda: door.core.stats(0).active == 0)

    run(tmp_path, redis_url, namespace, body)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"prompt": ""}, sdk.InvalidArgument, ["empty"]),
    ({"max_tokens": 0}, sdk.InvalidArgument, ["max_tokens", "0"]),
    ({"temperature": -1.0}, sdk.InvalidArgument, ["temperature"]),
    ({"top_p": 1.5}, sdk.InvalidArgument, ["top_p"]),
    ({"top_k": -1}, sdk.InvalidArgument, ["top_k"]),
    ({"prompt": "x" * 60, "max_tokens": 10}, sdk.InvalidArgument, ["60", "10", "64"]),
    ({"model": "gpt-9"}, sdk.NotFound, ["gpt-9"]),
    ({"api_key": "wrong"}, sdk.Unauthenticated, ["API key"]),
])
def test_bad_inputs_get_precise_statuses(tmp_path: Path, redis_url: str, namespace: str,
                                         kwargs: dict[str, Any], error: type, words: list[str]) -> None:
    """Each bad input gets its own status with a message naming the field or numbers, and nothing is submitted."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        args = {"prompt": "hi", "max_tokens": 4, **kwargs}
        key = args.pop("api_key", "k-acme")
        async with sdk.AsyncClient(target, api_key=key) as client:
            with pytest.raises(error) as info:
                await client.generate_text(args.pop("prompt"), **args)
        assert all(word in info.value.message for word in words), info.value.message
        assert replica.submitted == []

    run(tmp_path, redis_url, namespace, body)


def test_over_budget_is_resource_exhausted_without_side_effect(tmp_path: Path, redis_url: str,
                                                                namespace: str) -> None:
    """The third concurrent request over a budget of two gets RESOURCE_EXHAUSTED with a retry delay and is not submitted."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        no_retry = sdk.RetryPolicy(max_attempts=1)
        async with sdk.AsyncClient(target, api_key="k-acme", retry=no_retry) as client:
            streams = [client.generate("a", max_tokens=10), client.generate("b", max_tokens=10)]
            firsts = [await anext(s) for s in streams]
            with pytest.raises(sdk.ResourceExhausted) as info:
                await client.generate_text("c", max_tokens=10)
            assert info.value.retry_delay_s is not None and info.value.retry_delay_s > 0
            assert len(replica.submitted) == 2 and len(firsts) == 2
            for stream in streams:
                async for _ in stream:
                    pass
        assert await _settle(lambda: door.core.stats(0).active == 0)

    run(tmp_path, redis_url, namespace, body)


def test_other_tenant_cannot_cancel_or_read(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """Another tenant's Cancel and GetRequest on a live request get NOT_FOUND and change nothing."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme") as acme, \
                sdk.AsyncClient(target, api_key="k-beta") as beta:
            stream = acme.generate("hi", max_tokens=6)
            first = await anext(stream)
            with pytest.raises(sdk.NotFound):
                await beta.cancel(first.request_id)
            with pytest.raises(sdk.NotFound):
                await beta.get_request(first.request_id)
            rest = [chunk async for chunk in stream]
            info = await acme.get_request(first.request_id)
        assert replica.cancelled == [] and rest[-1].status == "FINISHED_LENGTH"
        assert info.status == "FINISHED_LENGTH" and info.finished and info.usage.output_tokens == 6
        assert {"received", "admitted", "routed", "finished"} <= set(info.timestamps), info.timestamps

    run(tmp_path, redis_url, namespace, body)


def test_cancel_and_disconnect_reach_the_scheduler(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """Cancel ends the stream as CANCELLED with no further tokens; a client that goes away cancels too."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            stream = client.generate("hi", max_tokens=11)
            first = await anext(stream)
            await client.cancel(first.request_id)
            with pytest.raises(sdk.Cancelled):
                async for _ in stream:
                    pass
            gone: AsyncIterator[sdk.Chunk] = client.generate("bye", max_tokens=11)
            second = await anext(gone)
            await gone.aclose()
        assert replica.cancelled[0] == first.request_id
        assert await _settle(lambda: second.request_id in replica.cancelled)
        assert await _settle(lambda: door.core.stats(0).active == 0)

    run(tmp_path, redis_url, namespace, body)


def test_idempotent_retry_attaches_instead_of_running_twice(tmp_path: Path, redis_url: str,
                                                            namespace: str) -> None:
    """Two calls with one idempotency key get the same request and the same text; the scheduler sees one Submit."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            first, second = await asyncio.gather(
                client.generate_text("hi", max_tokens=5, idempotency_key="same"),
                client.generate_text("hi", max_tokens=5, idempotency_key="same"))
        assert first.request_id == second.request_id and first.text == second.text == "hello"
        assert len(replica.submitted) == 1

    run(tmp_path, redis_url, namespace, body)


def test_restarted_consumer_claims_pending_completion(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A completion read by a consumer that died before acknowledging it is claimed by the next one and releases."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.core.admit("orphan", "acme", 3, 4, 0.0)
        group = "admission-restart"
        await bus.ensure_group("completions", group, "$")
        await bus.publish_completion(events_pb2.Completion(request_id="orphan", owner=OWNER,
                                                           status=common_pb2.FINISHED_STOP))
        # The dead consumer: read the entry (now pending for it) and never acknowledge.
        await bus.client.xreadgroup(group, "dead", {bus.key("completions"): ">"}, count=10)
        assert door.core.reservation("orphan") is not None
        stop = asyncio.Event()
        task = asyncio.create_task(bus.consume("completions", group, "fresh", door.on_completion, stop=stop,
                                               claim_idle_ms=50, block_ms=50))
        await asyncio.sleep(0.1)
        released = await _settle(lambda: door.core.reservation("orphan") is None)
        stop.set()
        await task
        assert released

    run(tmp_path, redis_url, namespace, body, consume=False)


def test_request_stream_drops_duplicates_and_waits_for_overtaken_tokens() -> None:
    """Repeated deltas are dropped by index, and a completion that overtakes its last tokens waits for them."""
    async def body() -> tuple[list[int], int, bool]:
        stream = RequestStream("r")
        stream.add_tokens(0, [1, 2], 0.0)
        stream.add_tokens(0, [1, 2, 3], 0.0)  # a redelivery that also carries one new token
        stream.set_completion(events_pb2.Completion(request_id="r", usage=common_pb2.Usage(output_tokens=4)))
        early = stream.complete_if_ready()
        stream.add_tokens(3, [4], 0.0)
        stream.complete_if_ready()
        items = [item async for item in stream.follow()]
        return [t for item in items for t in item.tokens], stream.duplicates, early

    tokens, duplicates, early = asyncio.run(body())
    assert tokens == [1, 2, 3, 4] and duplicates == 2 and early is False


def test_detokenizer_holds_back_split_utf8() -> None:
    """Incremental text never shows half a UTF-8 character and concatenates to the full text."""
    from sluice.tokenizer import Detokenizer, TextTokenizer

    tokenizer = TextTokenizer(build_byte_tokenizer())
    ids = tokenizer.encode("héllo €!")
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.push([token]) for token in ids]
    assert "".join(pieces) == "héllo €!" and all("\ufffd" not in p for p in pieces)
    cut = Detokenizer(tokenizer)
    held = cut.push(tokenizer.encode("ok €")[:-1])  # the euro sign's last byte never comes
    assert "\ufffd" not in held and held + cut.flush() == "ok \ufffd"


def test_retry_that_goes_away_does_not_cancel_the_original(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """When an attached retry disconnects while the first call still streams, the request is not cancelled."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            original = client.generate("hi", max_tokens=11, idempotency_key="k1")
            await anext(original)
            retry = client.generate("hi", max_tokens=11, idempotency_key="k1")
            await anext(retry)
            await retry.aclose()
            rest = [chunk async for chunk in original]
        assert rest[-1].status == "FINISHED_LENGTH" and replica.cancelled == []

    run(tmp_path, redis_url, namespace, body)


def test_no_ready_replica_is_unavailable_and_releases(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """With no READY replica the call (and a retry attached to it) gets UNAVAILABLE with the router's retry delay, and the reservation is released."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.ready = False
        async with sdk.AsyncClient(target, api_key="k-acme", retry=sdk.RetryPolicy(max_attempts=1)) as client:
            first = asyncio.create_task(client.generate_text("hi", max_tokens=4, idempotency_key="k"))
            await asyncio.sleep(0.05)
            with pytest.raises(sdk.Unavailable) as attached:  # the retry attached to the request that could not be placed
                await client.generate_text("hi", max_tokens=4, idempotency_key="k")
            with pytest.raises(sdk.Unavailable) as info:
                await first
        assert info.value.retry_delay_s == pytest.approx(0.5)
        assert attached.value.retry_delay_s == pytest.approx(0.5)  # the REJECTED stream carries the same RetryInfo
        assert door.core.stats(0).active == 0 and replica.submitted == []

    run(tmp_path, redis_url, namespace, body)


def test_bench_drive_records_every_outcome(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """The load generator replays a workload open-loop and records each request: tokens, a cancel, a rejection."""
    from sluice_tools.commands.bench import drive, path_latency, records_of
    from sluice_tools.workload import WorkloadRequest

    requests = [WorkloadRequest(f"w{i}", arrival_s=0.01 * i, input_length=4, output_length=5, tenant="acme")
                for i in range(3)]
    requests.append(WorkloadRequest("cancelled", arrival_s=0.05, input_length=4, output_length=11, tenant="acme",
                                    cancel_after_s=0.05))
    requests.append(WorkloadRequest("bad", arrival_s=0.06, input_length=4, output_length=100, tenant="acme"))

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        outcomes = await drive(target, {"acme": "k-acme"}, requests, max_concurrency=2, progress=False)
        records = records_of(requests, outcomes)
        assert [r.status for r in records] == ["ok", "ok", "ok", "cancelled", "failed"]
        assert all(r.output_tokens == 5 and len(r.token_times or ()) == 5 for r in records[:3])
        assert "64" in records[4].detail  # prompt + max_tokens over the model length, with the numbers
        assert path_latency(outcomes)["count"] == 15 + len(outcomes[3].path_latencies)

    run(tmp_path, redis_url, namespace, body)


def test_a_first_token_before_the_submit_reply_keeps_the_stages_in_order(
        tmp_path: Path, redis_url: str, namespace: str, span_exporter: Any) -> None:
    """When the first token arrives over Redis before the scheduler's Submit reply (a busy scheduler), the root span
    still has `submitted` before `first_token` with non-decreasing times, and the status (running, or finished when
    the reply came later still) is not set back to WAITING."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.submit_reply_delay_s = 0.3  # the stand-in's first token comes after 20 ms
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            stream = client.generate("hi there", max_tokens=len(OUTPUT))
            first = await anext(stream)
            record = door.records[first.request_id]
            assert await _settle(lambda: record.submitted)
            assert record.status in (common_pb2.RUNNING, common_pb2.FINISHED_LENGTH), record.status
            async for _ in stream:
                pass
        assert await _settle(lambda: any(s.name.startswith("text_completion") for s in span_exporter.get_finished_spans()))
        root = next(s for s in span_exporter.get_finished_spans() if s.name.startswith("text_completion"))
        events = [(e.name, e.timestamp) for e in root.events if e.name in ("routed", "submitted", "first_token")]
        assert [name for name, _ in events] == ["routed", "submitted", "first_token"], events
        assert [t for _, t in events] == sorted(t for _, t in events)

    run(tmp_path, redis_url, namespace, body)


def test_a_submit_that_times_out_after_its_request_finished_counts_it_once(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A Submit whose reply comes after the downstream timeout, by when the request already finished (a busy
    scheduler), leaves the active-requests gauge at 0: the completion and the undo do not both decrement it."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.submit_reply_delay_s = 1.5
        async with sdk.AsyncClient(target, api_key="k-acme", retry=sdk.RetryPolicy(max_attempts=1)) as client:
            with contextlib.suppress(sdk.SluiceError):  # refused or ended: what matters is the ledger below
                await client.generate_text("hi there", max_tokens=2, timeout=20)
        assert await _settle(lambda: door.core.stats(0).active == 0, timeout_s=10)
        await asyncio.sleep(2.0)  # any late undo has run
        assert door.metrics.registry.get_sample_value("sluice_admission_active_requests") == 0

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(downstream_timeout_s=0.5,
                                                                         migration_limit=0))
