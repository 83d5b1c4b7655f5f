"""A stopping publisher publishes what is queued, and does not wait for an unreachable Redis for ever.
Real Redis servers (one of this test's own, stopped mid-test)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from scheduler_svc.publisher import GRACE_AFTER_GIVING_UP_S, Outgoing, Publisher
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


def test_a_stop_after_a_flush_that_gave_up_waits_one_short_grace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A drain's flush that gave up waiting for a stopped Redis has already spent its grace: the stop that follows
    waits GRACE_AFTER_GIVING_UP_S, not a whole grace more (a drained replica exited two graces after its drain). Once
    Redis confirms a publication again, a stop waits its whole grace as before (a Redis paused for longer than the
    short grace still gets the last publication)."""
    redis = EmbeddedRedis(log_path=tmp_path / "redis.log")
    redis.start()
    restarted: list[EmbeddedRedis] = []

    async def scenario() -> tuple[float, bool, bool]:
        bus = Bus(redis_client(redis.url), "gone")
        publisher = Publisher(bus)
        run = asyncio.create_task(publisher.run())
        redis.stop()
        publisher.put(_tokens("after"))
        assert not await asyncio.wait_for(publisher.flush(grace_s=0.3), 30.0)
        await publisher.close()
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(publisher.wait_closed(run, grace_s=60.0), 30.0)
        waited = loop.time() - began

        first = EmbeddedRedis(log_path=tmp_path / "first.log")  # a flush gives up, then Redis comes back
        first.start()
        again = Publisher(Bus(redis_client(first.url), "back"))
        second = asyncio.create_task(again.run())
        first.stop()
        again.put(_tokens("queued"))
        assert not await again.flush(grace_s=0.3)
        back = EmbeddedRedis(port=first.port, log_path=tmp_path / "back.log")
        restarted.append(back)
        back.start()
        took_all = await again.flush(grace_s=20.0)
        # Redis confirmed again, so a stop waits its whole grace: a Redis that answers 1.5 s late still takes "last"
        pid = int((await again.bus.client.info("server"))["process_id"])
        os.kill(pid, signal.SIGSTOP)
        loop.call_later(1.5, os.kill, pid, signal.SIGCONT)
        again.put(_tokens("last"))
        await again.close()
        await again.wait_closed(second, grace_s=20.0)
        tail = await again.bus.read_tokens(again.bus.tokens_stream("owner-a"), "0")
        await again.bus.client.aclose()
        await bus.client.aclose()
        confirmed = not second.cancelled()  # cancelled: the stop gave up on "last" (which Redis may still take)
        return waited, took_all, confirmed and any(d.request_id == "last" for _, deltas in tail for d in deltas)

    try:
        waited, took_all, published = asyncio.run(scenario())
        assert waited < GRACE_AFTER_GIVING_UP_S + 2.0
        assert took_all and published
    finally:
        redis.stop()
        for server in restarted:
            server.stop()
