"""The replica's publisher on a real Redis: KV event batches coalesced in time, in order, none lost."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from scheduler_svc.publisher import Outgoing, Publisher
from sluice.bus import Bus
from sluice.v1 import events_pb2

pytestmark = pytest.mark.redis


class FakeClock:
    """The publisher's clock, moved by the test (so "the interval has passed" is a fact, not a race)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _kv(first_id: int, count: int = 1) -> Outgoing:
    batch = events_pb2.KvEventBatch(replica_id="r1")
    for event_id in range(first_id, first_id + count):
        batch.events.add(event_id=event_id, all_blocks_cleared=events_pb2.AllBlocksCleared())
    return Outgoing(kv=batch)


def _tokens(request_id: str, index: int) -> Outgoing:
    batch = events_pb2.TokenDeltaBatch()
    batch.deltas.add(request_id=request_id, index=index, token_ids=[7])
    return Outgoing(tokens={"adm-1": batch})


async def _kv_entries(bus: Bus) -> list[list[int]]:
    """Return the event ids of each KV entry of replica r1, entry by entry."""
    return [[event.event_id for event in events_pb2.KvEventBatch.FromString(payload).events]
            for _, payload, _ in await bus.read_stream(bus.kv_stream("r1"), "0", count=10_000, block_ms=10)]


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


def test_kv_batches_within_the_interval_go_out_as_one_entry_in_order(redis_url: str, namespace: str) -> None:
    """The first KV batch goes out at once; those queued before `kv_interval_s` has passed are held (tokens
    still go out) and leave as one entry, in order, once it has; flush and close send what is held."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        clock = FakeClock()
        publisher = Publisher(bus, kv_interval_s=0.05, clock=clock)
        running = asyncio.create_task(publisher.run())
        try:
            publisher.put(_kv(1))
            await _until(lambda: _has(bus, [[1]]))
            for event_id in (2, 3, 4):  # within the interval: held
                clock.now += 0.01
                publisher.put(_kv(event_id))
                await asyncio.sleep(0)
            publisher.put(_tokens("a", 0))
            await _until(lambda: _token_count(bus, 1))
            assert await _kv_entries(bus) == [[1]], "KV events within the interval are held while tokens go out"
            clock.now += 0.05  # the interval has passed: the publisher's own wake-up sends them
            await _until(lambda: _has(bus, [[1], [2, 3, 4]]))
            clock.now += 0.01
            publisher.put(_kv(5, 2))
            await publisher.flush()  # flush does not wait for the interval
            assert await _kv_entries(bus) == [[1], [2, 3, 4], [5, 6]]
            clock.now += 0.01
            publisher.put(_kv(7))
            await publisher.close()
            await running
            assert await _kv_entries(bus) == [[1], [2, 3, 4], [5, 6], [7]], "close sends what is held"
        finally:
            running.cancel()
            await client.aclose()
    asyncio.run(body())


def test_a_zero_interval_publishes_every_kv_batch_as_it_comes(redis_url: str, namespace: str) -> None:
    """kv_interval_s 0 holds nothing back: one entry per batch published alone."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        publisher = Publisher(bus, kv_interval_s=0.0)
        running = asyncio.create_task(publisher.run())
        try:
            for event_id in (1, 2, 3):
                publisher.put(_kv(event_id))
                await _until(lambda n=event_id: _has(bus, [[i] for i in range(1, n + 1)]))
            await publisher.close()
            await running
        finally:
            running.cancel()
            await client.aclose()
    asyncio.run(body())


async def _has(bus: Bus, entries: list[list[int]]) -> bool:
    return await _kv_entries(bus) == entries


async def _token_count(bus: Bus, want: int) -> bool:
    got = await bus.read_tokens(bus.tokens_stream("adm-1"), "0", count=10_000, block_ms=10)
    return sum(len(deltas) for _, deltas in got) >= want
