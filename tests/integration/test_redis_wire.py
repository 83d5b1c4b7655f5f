"""`sluice.redis_wire.Wire` against a real redis-server: error replies keep the connection, a stalled server is a
timeout within the bound (no timer per command, one watchdog), a connection the server drops is redis-py's
ConnectionError, and after either the next command runs on a fresh connection; nothing is left checked out."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.redis_server import EmbeddedRedis
from sluice.redis_wire import Wire, pack

pytestmark = pytest.mark.redis


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server this test alone may stop and resume."""
    server = EmbeddedRedis()
    server.start()
    yield server
    server.stop()


def test_an_error_reply_is_raised_as_redis_py_raises_it_and_the_connection_stays(redis_url: str,
                                                                                  namespace: str) -> None:
    """WRONGTYPE is a ResponseError and the very same connection answers the next command; in one exchange the
    replies around an error reply are returned in order, the error as its exception."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        wire = Wire(client)
        key = f"{namespace}:plain"
        assert await wire.call("SET", key, "v") == b"OK"
        connection = wire.connection
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await wire.call("XADD", key, "*", "f", "v")
        assert wire.connection is connection
        replies = await wire.exchange(pack(["PING"]) + pack(["XLEN", key]) + pack(["ECHO", "é"]), 3)
        assert replies[0] == b"PONG" and isinstance(replies[1], ResponseError) and replies[2] == "é".encode()
        assert wire.connection is connection
        await wire.close()
        assert wire.connection is None and len(client.connection_pool._in_use_connections) == 0
        await client.aclose()
    asyncio.run(body())


def test_an_acl_refusal_keeps_redis_pys_class(redis_url: str) -> None:
    """A NOPERM reply is redis-py's NoPermissionError (what the ACL tests and callers expect of redis-py)."""
    async def body() -> None:
        admin = aioredis.Redis.from_url(redis_url)
        user = f"wire-{os.getpid()}"
        await admin.acl_setuser(user, enabled=True, passwords=["+pw"], commands=["+ping"], keys=["*"])
        try:
            client = aioredis.Redis.from_url(redis_url, username=user, password="pw")
            wire = Wire(client)
            assert await wire.call("PING") == b"PONG"
            with pytest.raises(NoPermissionError):
                await wire.call("XLEN", "k")
            assert await wire.call("PING") == b"PONG"
            await wire.close()
            await client.aclose()
        finally:
            await admin.acl_deluser(user)
            await admin.aclose()
    asyncio.run(body())


def test_a_stalled_server_is_a_timeout_in_bound_and_the_next_command_gets_a_new_connection(
        own_redis: EmbeddedRedis) -> None:
    """SIGSTOP: a call with a 0.3 s timeout raises redis-py's TimeoutError well within a second (the watchdog aborts
    the connection), the connection is given back disconnected; once the server runs again the next call answers.
    A timeout that did not expire never fires later: a call that answered in time keeps its connection past it."""
    async def body() -> None:
        client = aioredis.Redis.from_url(own_redis.url)
        wire = Wire(client)
        assert await wire.call("PING", timeout_s=0.3) == b"PONG"
        kept = wire.connection
        await asyncio.sleep(0.5)  # past the first call's deadline: the watchdog finds no call under way
        assert await wire.call("PING") == b"PONG" and wire.connection is kept
        assert own_redis.pid is not None
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):  # not the outer bound's TimeoutError: the wire's own
                await asyncio.wait_for(wire.call("PING", timeout_s=0.3), 5.0)
            took = time.monotonic() - started
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        assert 0.25 <= took < 2.0, took
        assert wire.connection is None and len(client.connection_pool._in_use_connections) == 0
        assert await wire.call("PING", timeout_s=2.0) == b"PONG"
        await wire.close()
        await client.aclose()
    asyncio.run(body())


def test_a_connection_the_server_drops_is_a_connection_error_and_the_next_call_reconnects(redis_url: str) -> None:
    """CLIENT KILL of the wire's connection: the next call raises redis-py's ConnectionError (what the consume loops
    and the publisher retry on); the one after runs on a new connection."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        admin = aioredis.Redis.from_url(redis_url)
        wire = Wire(client)
        own_id = await wire.call("CLIENT", "ID")
        assert await admin.client_kill_filter(_id=own_id) == 1
        with pytest.raises(RedisConnectionError):
            for _ in range(3):  # the kill may land after a first write went out: the read sees it
                await wire.call("PING")
        assert await wire.call("PING") == b"PONG"
        assert await wire.call("CLIENT", "ID") != own_id
        await wire.close()
        await admin.aclose()
        await client.aclose()
    asyncio.run(body())
