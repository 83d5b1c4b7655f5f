"""A stopping publisher publishes what is queued, and does not wait for an unreachable Redis for ever.
Real Redis servers (one of this test's own, stopped mid-test)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.publisher import Outgoing, Publisher
from sluice.bus import Bus, redis_client
from sluice.redis_server import EmbeddedRedis
from sluice.v1 import events_pb2

pytestmark = pytest.mark.redis


def _tokens(request_id: str) -> Outgoing:
    batch = events_pb2.TokenDeltaBatch()
    batch.deltas.add(request_id=request_id, index=0, token_ids=[7])
    return Outgoing(tokens={"owner-a": batch})


def test_stopping_publishes_everything_queued(redis_url: str, namespace: str) -> None:
    """close() then wait_closed(): every batch queued before the close is in Redis when it returns."""
    async def scenario() -> int:
        bus = Bus(redis_client(redis_url), namespace)
        publisher = Publisher(bus)
        run = asyncio.create_task(publisher.run())
        for i in range(20):
            publisher.put(_tokens(f"r{i}"))
        await publisher.close()
        await publisher.wait_closed(run, grace_s=30.0)
        entries = await bus.read_tokens(bus.tokens_stream("owner-a"), "0")
        await bus.client.aclose()
        return sum(len(deltas) for _, deltas in entries)

    assert asyncio.run(scenario()) == 20


def test_stopping_with_redis_gone_ends_after_the_grace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With Redis stopped, wait_closed() returns after its grace (the run task cancelled) instead of retrying
    for ever, so a scheduler told to stop while Redis is away exits."""
    redis = EmbeddedRedis(log_path=tmp_path / "redis.log")
    redis.start()

    async def scenario() -> bool:
        bus = Bus(redis_client(redis.url), "gone")
        publisher = Publisher(bus)
        run = asyncio.create_task(publisher.run())
        publisher.put(_tokens("before"))
        await publisher.flush()
        redis.stop()
        publisher.put(_tokens("after"))
        await publisher.close()
        await asyncio.wait_for(publisher.wait_closed(run, grace_s=0.5), 30.0)
        return run.cancelled()

    try:
        assert asyncio.run(scenario())
    finally:
        redis.stop()


def test_a_flush_with_redis_gone_gives_up_after_its_grace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With Redis stopped and a batch queued, flush() returns False after its grace instead of waiting for ever (a
    drain flushes: a scheduler told to stop while Redis was gone never exited), and True once Redis took all."""
    redis = EmbeddedRedis(log_path=tmp_path / "redis.log")
    redis.start()

    async def scenario() -> tuple[bool, bool, float]:
        bus = Bus(redis_client(redis.url), "gone")
        publisher = Publisher(bus)
        run = asyncio.create_task(publisher.run())
        publisher.put(_tokens("before"))
        took_all = await publisher.flush()
        redis.stop()
        publisher.put(_tokens("after"))
        loop = asyncio.get_running_loop()
        began = loop.time()
        gave_up = not await asyncio.wait_for(publisher.flush(grace_s=0.5), 30.0)
        waited = loop.time() - began
        await publisher.close()
        await publisher.wait_closed(run, grace_s=0.1)
        return took_all, gave_up, waited

    try:
        took_all, gave_up, waited = asyncio.run(scenario())
        assert took_all and gave_up and 0.5 <= waited < 5.0
    finally:
        redis.stop()
