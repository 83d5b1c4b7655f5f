"""Commands in raw RESP on one connection of a redis-py pool: the bus's hot paths without redis-py's command path.

Theory of operation
- What it is for: the few commands the bus sends on every round or token batch (XADD of a publication, XREAD of the
  token reader, XREADGROUP and XACK of each consume loop). Through redis-py each costs its generic packing (an
  isinstance and an encode per argument), `send_packed_command` (a Task for `wait_for` when the client has a socket
  timeout) and `read_response`: a client's CPU per XADD of a 16-delta token batch 54 µs that way against 29 here,
  per XREAD of one entry 73 against 46 (medians of 5 alternated runs of 3,000, real Redis; docs/benchmarks.md,
  "Levers").
- redis-py still makes the connection (TLS, AUTH or HELLO, SELECT, the client name: whatever the URL says), taken
  from the client's pool on first use and kept until `close` (the publisher's never: closing the client closes it,
  as it does every connection of its pool); from then on its byte streams are this wire's: commands are packed here
  (`pack`; `xadd_head` keeps the constant head of each stream's XADD), written on the stream, and the replies
  parsed by a `hiredis.Reader` of the wire's own (RESP2 and RESP3 alike; an error reply comes back as the
  exception redis-py makes of it, and leaves the connection in step). redis-py's own parser never reads these streams.
- Failures: anything but an error reply (the server gone, a reset, a cancellation mid-reply, a timeout) leaves
  replies nobody will read, so the connection is disconnected and given back, the next call takes a new one, and
  it is raised as redis-py raises it (`redis.exceptions.ConnectionError`, `TimeoutError`), so the callers' retries
  are the same for both paths.
- Timeouts without a timer per command: a call with a timeout sets the wire's deadline; one timer per wire, armed
  only when none is, looks at the deadline when it fires and aborts the connection once it is past (re-armed for a
  later deadline). `asyncio.timeout` costs ~7.5 µs per use under uvloop, this a float store.
- One server only (a cluster client routes each command to its node: the bus uses redis-py's commands there), and
  one caller at a time: a wire belongs to one loop (the publisher, the token reader, one consume loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Wire", "pack", "pack_fields"]

_MORE = object()
"""What the reply parser gives while a reply is incomplete."""
_READ_SIZE = 65536


def _bulk(value: Any) -> bytes:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, int) and not isinstance(value, bool):
        data = b"%d" % value
    elif isinstance(value, (bytearray, memoryview)):
        data = bytes(value)
    else:  # redis-py refuses these too (a float it writes as repr: not needed by the bus)
        raise TypeError(f"a Redis command argument must be bytes, str or int, got {type(value).__name__}")
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack_fields(fields: Mapping[Any, Any]) -> bytes:
    """Return the RESP bulk strings of a stream entry's field pairs, in order (the tail of an XADD)."""
    return b"".join([_bulk(a) for pair in fields.items() for a in pair])


def pack(args: Sequence[Any]) -> bytes:
    """Return one command in RESP: an array of bulk strings (bytes as they are, str as UTF-8, int in decimal)."""
    return b"*%d\r\n%s" % (len(args), b"".join([_bulk(a) for a in args]))


class Wire:
    """One connection's commands in raw RESP (see the module docstring)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.connection: Any = None
        self._replies: Any = None
        self._stream: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._deadline = 0.0
        """While a call with a timeout is under way, the loop time past which the connection is aborted; else 0."""
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._heads: dict[tuple[str, int, int], bytes] = {}
        """XADD's head (up to the first field) for each (stream key, maxlen, number of fields) seen."""

    async def _open(self) -> None:
        connection = await self.client.connection_pool.get_connection()  # connected, authenticated, selected
        self.connection = connection
        self._stream, self._writer = connection._reader, connection._writer
        self._replies = hiredis.Reader(replyError=BaseParser.parse_error, notEnoughData=_MORE)  # redis-py's classes

    async def call(self, *args: Any, timeout_s: float | None = None) -> Any:
        """Send one command; return its reply as the parser gives it (no callbacks). Raises what Redis raises."""
        reply = (await self.exchange(pack(args), 1, timeout_s=timeout_s))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def exchange(self, data: bytes, replies: int, *, timeout_s: float | None = None,
                       into: list[Any] | None = None) -> list[Any]:
        """Write `data` (`replies` commands packed) and return the replies in order (appended to `into` as they
        come, when given), an error reply as the exception redis-py would raise for it (a `ResponseError`; the
        connection stays in step; one that redis-py counts a connection failure is raised).
        Raises redis-py's ConnectionError or TimeoutError when the connection fails or the timeout passes (the
        connection is then dropped; `into` holds the replies read before)."""
        if self.connection is None:
            await self._open()
        writer = self._writer
        assert writer is not None and self._stream is not None
        if timeout_s is not None:
            self._arm(timeout_s)
        try:
            writer.write(data)
            await writer.drain()
            out = [] if into is None else into
            parse = self._replies.gets
            while len(out) < replies:
                reply = parse()
                while reply is _MORE:
                    chunk = await self._stream.read(_READ_SIZE)
                    if not chunk:
                        raise RedisConnectionError("Connection closed by server.")
                    self._replies.feed(chunk)
                    reply = parse()
                if isinstance(reply, RedisConnectionError):  # LOADING, an expired login: not in step, as redis-py
                    raise reply
                out.append(reply)
        except BaseException as exc:
            expired = self._expired
            await self._drop()
            if expired:
                raise RedisTimeoutError(f"no reply from Redis within {timeout_s} s") from exc
            if isinstance(exc, OSError | asyncio.IncompleteReadError):
                raise RedisConnectionError(f"Error while talking to Redis: {exc!r}") from exc
            raise
        finally:
            self._deadline = 0.0
        return out

    def xadd_head(self, key: str, maxlen: int, fields: int) -> bytes:
        """Return the RESP of `XADD key MAXLEN ~ maxlen *` for an entry of `fields` field pairs (kept per key)."""
        head = self._heads.get((key, maxlen, fields))
        if head is None:
            if len(self._heads) > 4096:  # keys are a process's few streams; a bound all the same
                self._heads.clear()
            head = self._heads[(key, maxlen, fields)] = b"*%d\r\n%s" % (
                6 + 2 * fields, b"".join([_bulk(a) for a in ("XADD", key, "MAXLEN", "~", maxlen, "*")]))
        return head

    def _arm(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._check)

    def _check(self) -> None:
        self._timer = None
        deadline = self._deadline
        if not deadline:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self._timer = loop.call_at(deadline, self._check)
            return
        self._expired = True
        if self._writer is not None:
            self._writer.transport.abort()  # the pending read ends (EOF): `exchange` raises the timeout

    def _detach(self) -> Any:
        """Forget the connection and its streams; return it (None when there was none)."""
        connection, self.connection = self.connection, None
        self._stream = self._writer = self._replies = None
        return connection

    async def _drop(self) -> None:
        connection = self._detach()
        self._expired = False
        if connection is not None:
            await connection.disconnect(nowait=True)
            await self.client.connection_pool.release(connection)  # the pool connects it afresh when it is taken

    async def close(self) -> None:
        """Give the connection back to the client's pool (its loop is done); a timer still armed is cancelled."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        connection = self._detach()
        if connection is not None:
            await self.client.connection_pool.release(connection)
