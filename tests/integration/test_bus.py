"""The Redis bus against a real redis-server: at-least-once consumption, claiming, trimming, trace fields."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import pytest
import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import ResponseError

from sluice.bus import Bus
from sluice.telemetry import get_tracer
from sluice.v1 import events_pb2

pytestmark = pytest.mark.redis


def _batch(replica: str, event_id: int) -> events_pb2.KvEventBatch:
    batch = events_pb2.KvEventBatch(replica_id=replica)
    batch.events.add(event_id=event_id).block_stored.block_hashes.append(event_id * 7)
    return batch


async def _consume_until(bus: Bus, stream: str, group: str, consumer: str, want: int,
                         **kwargs: object) -> list[tuple[str, bytes]]:
    """Run bus.consume until `want` entries were handled (or 10 s); return (entry id, payload) in order."""
    seen: list[tuple[str, bytes]] = []
    stop = asyncio.Event()

    async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
        seen.append((entry_id, payload))
        if len(seen) >= want:
            stop.set()

    task = asyncio.create_task(bus.consume(stream, group, consumer, handler, stop=stop, block_ms=50,
                                           **kwargs))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(stop.wait(), timeout=10)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
    return seen


def test_publish_and_consume_round_trip_with_trace_context(redis_url: str, namespace: str,
                                                           span_exporter: object) -> None:
    """A KV batch published inside a span arrives as the same protobuf with that span's trace id in its context."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        with get_tracer("test").start_as_current_span("publisher") as span:
            trace_id = span.get_span_context().trace_id
            await bus.publish_kv(_batch("r1", 1))
        contexts = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, ctx: object) -> None:
            contexts.append((events_pb2.KvEventBatch.FromString(payload), ctx))
            stop.set()

        await asyncio.wait_for(bus.consume(bus.kv_stream("r1"), "routers", "c1", handler, stop=stop, block_ms=50), 10)
        batch, ctx = contexts[0]
        assert batch == _batch("r1", 1)
        assert trace.get_current_span(ctx).get_span_context().trace_id == trace_id  # type: ignore[arg-type]
        assert await client.xpending(bus.key(bus.kv_stream("r1")), "routers") == {
            "pending": 0, "min": None, "max": None, "consumers": []}
        await client.aclose()
    asyncio.run(body())


_DYING_CONSUMER = textwrap.dedent("""
    import asyncio, sys
    import redis.asyncio as aioredis
    from sluice.bus import Bus

    async def main():
        bus = Bus(aioredis.Redis.from_url(sys.argv[1]), sys.argv[2])
        stop = asyncio.Event()
        async def handler(entry_id, payload, ctx):
            print("reading", entry_id, flush=True)
            await asyncio.sleep(3600)  # never returns, so nothing is acknowledged
        await bus.consume("completions", "admission", "doomed", handler, stop=stop, count=100)

    asyncio.run(main())
""")


def test_entries_of_a_killed_consumer_are_claimed_and_handled_once(redis_url: str, namespace: str,
                                                                     subprocess_env: dict[str, str]) -> None:
    """Entries read but not acknowledged by a consumer process killed with SIGKILL are claimed by another
    consumer via XAUTOCLAIM and each handled exactly once, leaving nothing pending."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        ids = [await bus.publish_completion(events_pb2.Completion(request_id=f"req-{i}")) for i in range(20)]
        proc = subprocess.Popen([sys.executable, "-c", _DYING_CONSUMER, redis_url, namespace],
                                stdout=subprocess.PIPE, env=subprocess_env, text=True)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)  # type: ignore[union-attr]
            assert line.startswith("reading")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        pending = await client.xpending(bus.key("completions"), "admission")
        assert pending["pending"] == 20  # the dead consumer read all 20 and acknowledged none
        seen = await _consume_until(bus, "completions", "admission", "survivor", 20, claim_idle_ms=100)
        assert [entry_id for entry_id, _ in seen] == ids
        assert [events_pb2.Completion.FromString(p).request_id for _, p in seen] == [
            f"req-{i}" for i in range(20)]
        assert (await client.xpending(bus.key("completions"), "admission"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_claimed_entries_trimmed_away_are_acknowledged_not_handled(redis_url: str, namespace: str) -> None:
    """Entries a dead consumer read and that trimming removed before anyone handled them are claimed,
    acknowledged (the pending list empties) and not passed to the handler; later entries still are."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        await bus.ensure_group("completions", "g")
        for i in range(5):
            await bus.publish_completion(events_pb2.Completion(request_id=f"old-{i}"))
        await client.xreadgroup("g", "dead", {bus.key("completions"): ">"}, count=5)  # read, never acked
        await client.xtrim(bus.key("completions"), maxlen=0, approximate=False)
        await bus.publish_completion(events_pb2.Completion(request_id="new"))
        await asyncio.sleep(0.06)
        seen = await _consume_until(bus, "completions", "g", "survivor", 1, claim_idle_ms=50)
        assert [events_pb2.Completion.FromString(p).request_id for _, p in seen] == ["new"]
        assert (await client.xpending(bus.key("completions"), "g"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_publishing_trims_the_stream_approximately(redis_url: str, namespace: str) -> None:
    """Publishing far more than maxlen entries keeps the stream bounded, and never below maxlen."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace, maxlen=50)
        for i in range(1000):
            await bus.publish_completion(events_pb2.Completion(request_id=str(i)))
        length = await client.xlen(bus.key("completions"))
        assert 50 <= length < 1000
        await client.aclose()
    asyncio.run(body())


def test_failing_handler_is_retried_then_dead_lettered(redis_url: str, namespace: str) -> None:
    """An entry whose handler always raises is retried max_attempts times, then parked on `{stream}:dead`
    with the error and acknowledged, while later entries are still handled."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        bad = await bus.publish_completion(events_pb2.Completion(request_id="poison"))
        await bus.publish_completion(events_pb2.Completion(request_id="fine"))
        attempts: list[str] = []
        handled: list[str] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            request_id = events_pb2.Completion.FromString(payload).request_id
            if request_id == "poison":
                attempts.append(entry_id)
                raise ValueError("cannot handle this one")
            handled.append(request_id)

        task = asyncio.create_task(bus.consume("completions", "g", "c", handler, stop=stop, block_ms=20,
                                               max_attempts=3))
        for _ in range(200):
            if await client.xlen(bus.key("completions", "dead")):
                break
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 5)
        assert attempts == [bad] * 3 and handled == ["fine"]
        dead = await client.xrange(bus.key("completions", "dead"))
        assert len(dead) == 1
        assert dead[0][1][b"source_id"] == bad.encode() and b"cannot handle" in dead[0][1][b"error"]
        assert (await client.xpending(bus.key("completions"), "g"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_a_read_is_acknowledged_in_one_xack_and_a_failed_entry_stays_pending(redis_url: str,
                                                                             namespace: str) -> None:
    """Twenty entries read at once are acknowledged with one XACK (not one each), and an entry whose handler
    raised is left out of it: it alone stays in the consumer's pending list."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        ids = [await bus.publish_completion(events_pb2.Completion(request_id=str(i))) for i in range(20)]
        handled: list[str] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            request_id = events_pb2.Completion.FromString(payload).request_id
            if request_id == "7":
                raise ValueError("not now")
            handled.append(request_id)
            if len(handled) == 19:
                stop.set()

        before = (await client.info("commandstats")).get("cmdstat_xack", {}).get("calls", 0)
        await asyncio.wait_for(bus.consume("completions", "g", "c", handler, stop=stop, block_ms=20,
                                           max_attempts=1000), 10)
        xacks = (await client.info("commandstats"))["cmdstat_xack"]["calls"] - before
        assert handled == [str(i) for i in range(20) if i != 7]
        assert 1 <= xacks <= 3  # one per read that handled something; one per entry would be 19
        pending = await client.xpending_range(bus.key("completions"), "g", min="-", max="+", count=100)
        assert [entry["message_id"] for entry in pending] == [ids[7].encode()]
        await client.aclose()
    asyncio.run(body())


def test_a_read_cancelled_while_it_blocks_leaves_no_reply_for_the_next(redis_url: str, namespace: str) -> None:
    """A blocking token read cancelled mid-BLOCK (a stopping reader) gives up its connection: the reply Redis
    still sends for it (stream A's entry) never answers the next read (stream B's), which gets its own entry."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        waiting = asyncio.create_task(bus.read_tokens("tokens:a", "$", block_ms=5000))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await bus.publish_token_batch("a", events_pb2.TokenDeltaBatch())
        b_id = await bus.publish_token_batch("b", events_pb2.TokenDeltaBatch())
        [(entry_id, _deltas)] = await bus.read_tokens("tokens:b", "0", block_ms=100)
        assert entry_id == b_id
        await client.aclose()
    asyncio.run(body())


def test_a_minimum_interval_reads_a_busy_stream_in_batches(redis_url: str, namespace: str) -> None:
    """Entries written every 5 ms for 0.4 s, consumed with min_interval_s 0.1: every one handled, in order, in a
    handful of reads (one per entry or so without it, as each write wakes the blocked read)."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        reads_before = (await client.info("commandstats")).get("cmdstat_xreadgroup", {}).get("calls", 0)
        handled: list[str] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            handled.append(events_pb2.Completion.FromString(payload).request_id)
            if len(handled) == 80:
                stop.set()

        consuming = asyncio.create_task(bus.consume("completions", "g", "c", handler, stop=stop, block_ms=50,
                                                    min_interval_s=0.1))
        await asyncio.sleep(0.05)
        for i in range(80):
            await bus.publish_completion(events_pb2.Completion(request_id=str(i)))
            await asyncio.sleep(0.005)
        await asyncio.wait_for(consuming, 10)
        reads = (await client.info("commandstats"))["cmdstat_xreadgroup"]["calls"] - reads_before
        assert handled == [str(i) for i in range(80)]
        assert reads <= 15, reads  # ~0.4-0.8 s of writes at one read per 0.1 s, and the pending-list reads
        assert (await client.xpending(bus.key("completions"), "g"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_token_deltas_read_in_order_with_trace_fields(redis_url: str, namespace: str,
                                                      span_exporter: object) -> None:
    """Token deltas published in one pipelined call are read back by XREAD in order, each with trace fields."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        deltas = [events_pb2.TokenDelta(request_id="r", index=i, token_ids=[100 + i]) for i in range(5)]
        with get_tracer("test").start_as_current_span("decode"):
            await bus.publish_tokens("adm-1", deltas)
        entries = await bus.read_stream(bus.tokens_stream("adm-1"), "0", block_ms=50)
        assert [events_pb2.TokenDelta.FromString(p) for _, p, _ in entries] == deltas
        assert all("traceparent" in fields for _, _, fields in entries)
        later = await bus.read_stream(bus.tokens_stream("adm-1"), entries[-1][0], block_ms=20)
        assert later == []
        await client.aclose()
    asyncio.run(body())


def test_token_batches_and_single_deltas_read_back_in_order(redis_url: str, namespace: str) -> None:
    """A TokenDeltaBatch is one stream entry, and read_tokens returns its deltas and older single-delta entries in
    publication order (a reader accepts both kinds of entry on one stream)."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        stream = bus.tokens_stream("adm-1")
        single = events_pb2.TokenDelta(request_id="old", index=0, token_ids=[7])
        await bus.publish_tokens("adm-1", [single])
        batch = events_pb2.TokenDeltaBatch()
        for i in range(300):
            batch.deltas.add(request_id=f"r{i}", index=i % 3, token_ids=[i, i + 1], created_unix_s=1.5)
        await bus.publish_token_batch("adm-1", batch)
        await bus.publish_token_batch("adm-1", batch.SerializeToString())
        assert await client.xlen(bus.key(stream)) == 3
        entries = await bus.read_tokens(stream, "0", block_ms=50)
        assert [len(deltas) for _, deltas in entries] == [1, 300, 300]
        assert entries[0][1] == [single]
        assert entries[1][1] == list(batch.deltas) == entries[2][1]
        assert await bus.read_tokens(stream, entries[-1][0], block_ms=20) == []
        await client.aclose()
    asyncio.run(body())


def test_append_writes_every_entry_in_order_in_one_call_and_resumes_after_a_refused_one(
        redis_url: str, namespace: str, span_exporter: object) -> None:
    """`append` puts tokens, a completion (with its trace context) and KV events on their streams in order and
    empties the list; when Redis refuses an entry (its key is not a stream) the entries it confirmed, before and
    after that one, are gone from the list, the refused one stays, and a retry once the cause is gone publishes
    exactly it, on the same connection."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        batch = events_pb2.TokenDeltaBatch()
        batch.deltas.add(request_id="a", index=0, token_ids=[5, 6])
        completion = events_pb2.Completion(request_id="a")
        with get_tracer("test").start_as_current_span("publish"):
            entries = [bus.token_batch_entry("adm-1", batch), bus.completion_entry(completion),
                       bus.kv_entry(_batch("r1", 1))]
        await bus.append(entries)
        assert entries == []
        [(_, deltas)] = await bus.read_tokens(bus.tokens_stream("adm-1"), "0", block_ms=10)
        assert deltas == list(batch.deltas)
        [(_, payload, fields)] = await bus.read_stream("completions", "0", block_ms=10)
        assert events_pb2.Completion.FromString(payload) == completion and "traceparent" in fields
        [(_, payload, _)] = await bus.read_stream(bus.kv_stream("r1"), "0", block_ms=10)
        assert events_pb2.KvEventBatch.FromString(payload) == _batch("r1", 1)

        await client.set(bus.key("kv:0"), "not a stream")  # the refused entry's key
        on_kv0 = next(f"r{i}" for i in range(100) if bus.kv_stream(f"r{i}") == "kv:0")
        blocked = events_pb2.KvEventBatch(replica_id=on_kv0)
        entries = [bus.token_batch_entry("adm-1", batch), bus.kv_entry(blocked), bus.token_batch_entry("adm-2", batch)]
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await bus.append(entries)
        assert [entry.key for entry in entries] == [bus.key("kv:0")], "only the refused entry is left"
        await client.delete(bus.key("kv:0"))
        await bus.append(entries)
        assert entries == []
        assert await client.xlen(bus.key(bus.tokens_stream("adm-1"))) == 2, "confirmed entries are not repeated"
        assert await client.xlen(bus.key(bus.tokens_stream("adm-2"))) == 1
        assert await client.xlen(bus.key("kv:0")) == 1
        await client.aclose()
    asyncio.run(body())


def test_bus_rejects_a_namespace_with_a_separator(redis_url: str) -> None:
    """A namespace containing ':' would make keys ambiguous, so Bus refuses it with ValueError."""
    with pytest.raises(ValueError, match="namespace"):
        Bus(aioredis.Redis.from_url(redis_url), "a:b")
