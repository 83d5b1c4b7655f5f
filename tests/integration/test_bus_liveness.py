"""Redis going away and coming back, against a real redis-server of the test's own: the liveness probe, the
health it drives, consumers that resume (their groups recreated), and the embedded server's restart."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from sluice.bus import Bus
from sluice.redis_server import EmbeddedRedis, _ping
from sluice.serve import BusWatch
from sluice.v1 import events_pb2

pytestmark = pytest.mark.redis


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server with a password that this test alone may kill and restart."""
    server = EmbeddedRedis(password="s3cret-pw")
    server.start()
    yield server
    server.stop()


def _kill9(server: EmbeddedRedis) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    while server.running:
        pass


def _completion(request_id: str) -> bytes:
    return events_pb2.Completion(request_id=request_id).SerializeToString()


def test_embedded_redis_restarts_on_its_port_with_its_password(own_redis: EmbeddedRedis) -> None:
    """After kill -9, restart() brings the server back on the same port and URL; it still demands the password."""
    url, port = own_redis.url, own_redis.port
    _kill9(own_redis)
    assert own_redis.returncode == -signal.SIGKILL
    assert own_redis.restart() == url
    assert own_redis.port == port and own_redis.running
    assert _ping(port, password="s3cret-pw") and not _ping(port)


def test_bus_watch_reports_down_and_back_and_drives_health(own_redis: EmbeddedRedis, namespace: str) -> None:
    """The probe turns `alive` False (health NOT_SERVING) when Redis dies, and True (SERVING) once it is back."""
    async def body() -> None:
        client = aioredis.Redis.from_url(own_redis.url)
        watch = BusWatch(Bus(client, namespace), timeout_s=0.5)
        health = health_aio.HealthServicer()
        seen: list[bool] = []

        async def listener(alive: bool) -> None:
            seen.append(alive)
            await health.set("", health_pb2.HealthCheckResponse.SERVING if alive
                             else health_pb2.HealthCheckResponse.NOT_SERVING)

        watch.listeners.append(listener)
        assert await watch.probe() and seen == []
        _kill9(own_redis)
        assert not await watch.probe() and not watch.alive
        status = await health.Check(health_pb2.HealthCheckRequest(service=""), None)  # type: ignore[arg-type]
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        own_redis.restart()
        assert await watch.probe() and watch.alive
        status = await health.Check(health_pb2.HealthCheckRequest(service=""), None)  # type: ignore[arg-type]
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert seen == [False, True]
        await client.aclose()

    asyncio.run(body())


def test_one_late_ping_is_not_down_two_in_a_row_are(own_redis: EmbeddedRedis, namespace: str) -> None:
    """A stalled Redis (SIGSTOP: the connection is open, nothing answers) is down after `late_limit` late PINGs in a
    row, not after the first (a busy event loop can miss one timeout); an answer resets the count."""
    async def body() -> None:
        client = aioredis.Redis.from_url(own_redis.url)
        watch = BusWatch(Bus(client, namespace), timeout_s=0.3, late_limit=2)
        seen: list[bool] = []

        async def listener(alive: bool) -> None:
            seen.append(alive)

        watch.listeners.append(listener)
        assert await watch.probe()
        assert own_redis.pid is not None
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            assert await watch.probe() and watch.alive and watch.late == 1 and seen == []
            assert not await watch.probe() and not watch.alive and seen == [False]
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        assert await _eventually(watch) and seen == [False, True] and watch.late == 0
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            assert await watch.probe() and watch.late == 1
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        assert await _eventually(watch) and watch.late == 0
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            assert await watch.probe() and watch.alive and seen == [False, True]  # the answer in between reset it
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        await client.aclose()

    asyncio.run(body())


async def _eventually(watch: BusWatch) -> bool:
    """Probe until the watch says alive (the late PINGs' replies arrive first once Redis runs again)."""
    for _ in range(20):
        if await watch.probe():
            return True
    return False


def test_consumer_recreates_a_lost_group_and_keeps_consuming(redis_url: str, namespace: str) -> None:
    """A group that vanishes under a running consumer (as with a restarted Redis) is created again and what is
    published afterwards is delivered (without the fix, the consumer dies of NOGROUP)."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        seen: list[bytes] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            seen.append(payload)

        task = asyncio.create_task(bus.consume("completions", "g", "c", handler, stop=stop,  # type: ignore[arg-type]
                                               block_ms=50))
        await bus.publish("completions", _completion("a"))
        await _until(lambda: len(seen) == 1)
        await client.xgroup_destroy(bus.key("completions"), "g")
        await asyncio.sleep(0.2)
        await bus.publish("completions", _completion("b"))
        ids = lambda: [events_pb2.Completion.FromString(p).request_id for p in seen]  # noqa: E731
        await _until(lambda: "b" in ids())
        stop.set()
        await asyncio.wait_for(task, 5)
        # Recreated from "0": what the stream still holds comes again (at-least-once; handlers are idempotent).
        assert ids()[0] == "a" and set(ids()) == {"a", "b"}
        await client.aclose()

    asyncio.run(body())


def test_consumer_resumes_after_redis_is_killed_and_restarted(own_redis: EmbeddedRedis, namespace: str) -> None:
    """A consumer restarted on connection errors (as the services' loops are) delivers what is published after
    Redis was killed and restarted, with the same client."""
    async def body() -> None:
        client = aioredis.Redis.from_url(own_redis.url)
        bus = Bus(client, namespace)
        seen: list[str] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            seen.append(events_pb2.Completion.FromString(payload).request_id)

        async def supervised() -> None:
            while not stop.is_set():
                try:
                    await bus.consume("completions", "g", "c", handler, stop=stop, block_ms=50)  # type: ignore[arg-type]
                except Exception:  # Redis away: retry, as the router's and admission's loops do
                    await asyncio.sleep(0.1)

        task = asyncio.create_task(supervised())
        await bus.publish("completions", _completion("before"))
        await _until(lambda: seen == ["before"])
        _kill9(own_redis)
        await asyncio.sleep(0.3)
        own_redis.restart()
        await _until(lambda: _publish_ok(bus, "after"), timeout_s=10)
        await _until(lambda: "after" in seen, timeout_s=10)
        stop.set()
        await asyncio.wait_for(task, 5)
        assert seen == ["before", "after"]
        await client.aclose()

    asyncio.run(body())


_published: set[str] = set()


async def _publish_ok(bus: Bus, request_id: str) -> bool:
    if request_id in _published:
        return True
    try:
        await bus.publish("completions", _completion(request_id))
    except Exception:
        return False
    _published.add(request_id)
    return True


async def _until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
