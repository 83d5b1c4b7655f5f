"""The Redis bus: KV events, completions and token deltas as protobuf bytes on Redis streams.

Theory of operation
- Keys are namespaced and carry a Redis Cluster hash tag: `sluice:{<namespace>:<stream>}[:suffix]`, so a
  stream and its dead-letter stream (`...:dead`) share a slot, and different streams spread over the
  cluster's shards. Every command and script touches one key, so no command ever crosses slots.
- Streams: `kv:<shard>` (KV event batches; replica R always publishes on shard crc32(R) % kv_shards, so a
  replica's batches stay in order on one stream and the replicas spread over `kv_shards` streams; a
  router runs one consumer per shard: XREADGROUP on several keys in one call needs them in one slot),
  `completions` (terminal records), `tokens:<owner>` (token deltas for one admission process).
- Every entry has the protobuf bytes in field `p` and, when a span is active, the W3C trace context in
  fields `traceparent`/`tracestate`. Exception: a `tokens:<owner>` entry written by `publish_token_batch`
  holds a TokenDeltaBatch (every delta of one publication for that owner) in field `d`, and no trace
  context (the requests' traces are on their Completions); `read_tokens` reads both kinds.
- Publishing trims each stream approximately (`XADD MAXLEN ~ maxlen`): cheap, and never below `maxlen`.
- `consume` gives at-least-once delivery to a consumer group: XREADGROUP, the handler is awaited, XACK
  after it returns. Entries a consumer read but never acknowledged (it died, or its handler raised) are
  taken over with XAUTOCLAIM once idle for `claim_idle_ms`, by any consumer of the group. Handlers must
  therefore be idempotent. An entry whose handler fails `max_attempts` times in one consumer, or that
  has no payload, is moved to the stream `{stream}:dead` with the error and acknowledged, and logged:
  it is parked where an operator can see it, never dropped silently.
- Poison entries: an entry whose payload does not parse (DecodeError: garbage written by anyone who may
  write there) is not retried, since it never will parse: `consume` dead-letters and acknowledges it at
  once, and `read_tokens` (the plain XREAD of admission's token reader, which has no group to acknowledge
  in and may not write the token stream) skips it. Either way it is counted per stream (`poisoned`, and
  `sluice_bus_poison_entries_total{stream}` once `count_poison_in` named a registry) and logged once with
  its stream and id; the entries around it are delivered as usual.
- Redis restarts: redis-py reconnects per command, so loops that catch connection errors and retry
  resume by themselves. A restarted Redis (no persistence) has lost the consumer groups: `consume`
  meets NOGROUP and creates its group again from "0" (everything in the new stream is unseen).
  `ping` is the liveness probe (`sluice.serve.BusWatch` turns gRPC health NOT_SERVING while it fails).
- `read_stream` is a plain XREAD for the one token-reader loop of each admission process.

Connecting (`redis_client`): `redis://` or `rediss://` (TLS; `?ssl_ca_certs=FILE` names the CA to verify
the server against, `ssl_certfile`/`ssl_keyfile` a client certificate); `redis+cluster://` or
`rediss+cluster://` (any one node of a Redis or Valkey Cluster) for a cluster client, which finds the
other nodes itself and sends each command to the node that holds its key's slot. The password is taken from the
URL (`redis://[user]:password@host`, as set in $SLUICE_REDIS_URL) or, when the URL has none, from the
file named by $SLUICE_REDIS_PASSWORD_FILE. Secrets travel by environment or file only, never on a
command line; anything printed or logged about the URL goes through `redact_url`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from opentelemetry.context import Context
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.redis_wire import Wire, pack_fields
from sluice.telemetry import TRACE_FIELDS, extract_fields, inject_fields
from sluice.v1 import events_pb2

__all__ = ["Bus", "DEFAULT_KV_SHARDS", "Entry", "Handler", "PAYLOAD_FIELD", "PASSWORD_FILE_ENV", "PING_FAILED",
           "PING_LATE", "PING_OK", "RedisClient", "TOKEN_BATCH_FIELD", "redact_url", "redis_client",
           "split_cluster_url", "token_deltas_of"]

log = logging.getLogger(__name__)

PAYLOAD_FIELD = "p"
TOKEN_BATCH_FIELD = "d"
"""The field of a `tokens:<owner>` entry that holds a TokenDeltaBatch (instead of one TokenDelta in `p`)."""
_PAYLOAD_KEY = PAYLOAD_FIELD.encode()
_BATCH_KEY = TOKEN_BATCH_FIELD.encode()
PASSWORD_FILE_ENV = "SLUICE_REDIS_PASSWORD_FILE"
DEFAULT_KV_SHARDS = 4
"""KV event streams per namespace: enough to spread over a small cluster, few enough for one router's loops."""
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that ask for a cluster client, and the plain scheme each stands for."""

RedisClient = aioredis.Redis | RedisCluster
"""A client of one Redis server or of a Redis Cluster: the bus uses only commands both route alike."""

PING_OK, PING_LATE, PING_FAILED = "ok", "late", "failed"
"""What `Bus.probe` saw: an answer, no answer in time, or a failure (refused, reset, auth)."""

# Appends many entries to one stream in one call. Measured against a pipeline of XADDs for 256 token
# deltas: about 1.8 ms instead of 8-13 ms, nearly all of the difference being redis-py's per-command
# packing and reply parsing. ARGV: maxlen, then per entry the number of field pairs and the pairs.
_XADD_MANY = """
local i, n = 2, 0
while i <= #ARGV do
  local k = tonumber(ARGV[i])
  local fields = {}
  for j = 1, 2 * k do fields[j] = ARGV[i + j] end
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
  i = i + 1 + 2 * k
  n = n + 1
end
return n
"""
Handler = Callable[[str, bytes, Context], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry to append: the Redis key of its stream and its fields."""

    key: str
    fields: dict[Any, Any]


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries_of(reply: Any) -> list[tuple[Any, Any]]:
    """Return the (id, fields) entries of an XREAD/XREADGROUP reply, in order, whichever protocol shaped it
    (RESP2: [[stream, entries], ...]; RESP3: {stream: entries})."""
    if not reply:
        return []
    groups = reply.values() if isinstance(reply, dict) else (item[1] for item in reply)
    return [entry for entries in groups for entry in entries or ()]


def _trace_fields(fields: dict[Any, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in fields.items():
        k = _str(key)
        if k in TRACE_FIELDS:
            out[k] = _str(value)
    return out


def token_deltas_of(fields: Mapping[Any, Any]) -> list[events_pb2.TokenDelta]:
    """Return the token deltas of one `tokens:<owner>` entry's fields, in order: the deltas of a TokenDeltaBatch
    (field `d`) or the one TokenDelta (field `p`); [] for an entry with neither. Raises DecodeError when the
    bytes do not parse."""
    batch = fields.get(_BATCH_KEY, fields.get(TOKEN_BATCH_FIELD))
    if batch is not None:
        return list(events_pb2.TokenDeltaBatch.FromString(bytes(batch)).deltas)
    payload = fields.get(_PAYLOAD_KEY, fields.get(PAYLOAD_FIELD))
    return [] if payload is None else [events_pb2.TokenDelta.FromString(bytes(payload))]


def redact_url(url: str) -> str:
    """Return `url` with its password (if any) replaced by `***`, for banners, logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_client(url: str, password_file: str | None = None) -> RedisClient:
    """Return an asyncio client for `url` (a cluster client for `redis+cluster://` and `rediss+cluster://`).

    Without a password in the URL, the password is read from `password_file` (default: the file named
    by $SLUICE_REDIS_PASSWORD_FILE, if set; one trailing newline is ignored).
    Raises ValueError for a malformed URL, OSError for an unreadable file.
    """
    parts = urlsplit(url)
    kwargs: dict[str, Any] = {}
    password_file = password_file or os.environ.get(PASSWORD_FILE_ENV) or None
    if parts.password is None and password_file:
        with open(password_file, encoding="utf-8") as secret:
            kwargs["password"] = secret.read().removesuffix("\n").removesuffix("\r")
    plain_url, cluster = split_cluster_url(url)
    if not cluster:
        return aioredis.Redis.from_url(url, **kwargs)
    return RedisCluster.from_url(plain_url, **kwargs)


def split_cluster_url(url: str) -> tuple[str, bool]:
    """Return (`url` with a `redis+cluster`/`rediss+cluster` scheme made plain, whether it named a cluster)."""
    parts = urlsplit(url)
    plain_scheme = CLUSTER_SCHEMES.get(parts.scheme)
    if plain_scheme is None:
        return url, False
    return urlunsplit(parts._replace(scheme=plain_scheme)), True


def _raw_entries(reply: Any) -> list[tuple[Any, dict[Any, Any] | None]]:
    """`_entries_of` a reply read on a `Wire`: each entry's fields are the flat [field, value, ...] list Redis sends
    (redis-py's callbacks make the dict), None for an entry trimmed away (XREADGROUP of a pending list)."""
    return [(entry_id, None if fields is None else dict(zip(fields[::2], fields[1::2], strict=True)))
            for entry_id, fields in _entries_of(reply)]


READ_MARGIN_S = 5.0
"""How long past a blocking read's own BLOCK a `Wire` waits for its reply before it gives up on the connection."""


class Bus:
    """Publishes and consumes Sluice's Redis streams for one namespace.

    The client must return bytes (the default `decode_responses=False`): payloads are protobuf bytes.
    """

    def __init__(self, client: RedisClient, namespace: str = "default", maxlen: int = 100_000,
                 kv_shards: int = DEFAULT_KV_SHARDS) -> None:
        if not namespace or any(c in namespace for c in ":{}"):
            raise ValueError(f"namespace must be non-empty and contain no ':', '{{' or '}}', got {namespace!r}")
        if maxlen <= 0:
            raise ValueError(f"maxlen must be positive, got {maxlen}")
        if kv_shards < 1:
            raise ValueError(f"kv_shards must be >= 1, got {kv_shards}")
        self.client = client
        self.namespace = namespace
        self.maxlen = maxlen
        self.kv_shards = kv_shards
        self._xadd_many = client.register_script(_XADD_MANY)
        self.poisoned: dict[str, int] = {}
        """Entries skipped because they do not parse, per logical stream (see the module docstring)."""
        self._poison_counter: Any = None
        self._poison_seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._writer = self.line()
        """The connection `append` writes on (None on a cluster; taken on first use, again after a failure)."""
        self._token_line = self.line()
        """`read_tokens`' own connection (None on a cluster)."""
        self._append_timeout_s: float | None = (
            None if isinstance(client, RedisCluster) else client.connection_pool.connection_kwargs.get("socket_timeout"))
        """The client's socket timeout (`?socket_timeout=` in the URL; none by default), for `append`'s round trip."""

    def line(self) -> Wire | None:
        """A connection of its own for one loop's commands in raw RESP (`sluice.redis_wire.Wire`); None on a
        cluster, whose client routes each command to its node (there the loop uses redis-py's commands)."""
        return None if isinstance(self.client, RedisCluster) else Wire(self.client)

    def count_poison_in(self, registry: Any) -> None:
        """Also count poison entries in `sluice_bus_poison_entries_total{stream}` of a Prometheus registry."""
        from prometheus_client import Counter

        self._poison_counter = Counter("sluice_bus_poison_entries", "Bus entries skipped because they do not "
                                       "parse (dead-lettered where the consumer may write), by stream.",
                                       ["stream"], registry=registry)

    def poison(self, stream: str, entry_id: str, error: str) -> None:
        """Count and log an entry of `stream` that does not parse, once however many reads meet it (a reader that
        retries a batch, or reads a range again to recover, sees the same entry again; the last 1,024 are kept)."""
        seen = (stream, entry_id)
        if seen in self._poison_seen:
            return
        self._poison_seen[seen] = None
        if len(self._poison_seen) > 1024:
            self._poison_seen.popitem(last=False)
        family = stream.split(":", 1)[0]  # tokens:<owner>, kv:<shard>: one label per kind of stream
        self.poisoned[stream] = self.poisoned.get(stream, 0) + 1
        if self._poison_counter is not None:
            self._poison_counter.labels(family).inc()
        log.error("skipped entry %s of %s: it does not parse (%s)", entry_id, self.key(stream), error)

    def key(self, stream: str, *suffix: str) -> str:
        """Return the Redis key of logical stream `stream`: `sluice:{namespace:stream}` plus `:suffix` parts.

        The braces are a Redis Cluster hash tag: keys of one stream (its dead letters) share a slot.
        """
        return ":".join((f"sluice:{{{self.namespace}:{stream}}}", *suffix))

    def kv_stream(self, replica_id: str) -> str:
        """Return the logical `kv` shard stream that replica `replica_id` publishes on (stable, by crc32)."""
        return f"kv:{zlib.crc32(replica_id.encode()) % self.kv_shards}"

    def kv_streams(self) -> list[str]:
        """Return every logical `kv` shard stream of the namespace (what a router consumes)."""
        return [f"kv:{shard}" for shard in range(self.kv_shards)]

    @staticmethod
    def tokens_stream(owner: str) -> str:
        """Return the logical stream name of the token deltas for admission process `owner`."""
        return f"tokens:{owner}"

    def _entry(self, payload: bytes, context: Context | None) -> dict[Any, Any]:
        fields: dict[Any, Any] = {PAYLOAD_FIELD: payload}
        fields.update(inject_fields(context))
        return fields

    async def publish(self, stream: str, payload: bytes, *, context: Context | None = None) -> str:
        """Append `payload` to logical stream `stream` (trimmed to about maxlen); return the entry id."""
        entry_id = await self.client.xadd(self.key(stream), self._entry(payload, context),
                                          maxlen=self.maxlen, approximate=True)
        return _str(entry_id)

    def kv_entry(self, batch: events_pb2.KvEventBatch, context: Context | None = None) -> Entry:
        """Return the entry that publishes one replica's batch of KV events on its `kv` shard stream."""
        return Entry(self.key(self.kv_stream(batch.replica_id)), self._entry(batch.SerializeToString(), context))

    def completion_entry(self, completion: events_pb2.Completion, context: Context | None = None) -> Entry:
        """Return the entry that publishes a request's terminal record on `completions`."""
        return Entry(self.key("completions"), self._entry(completion.SerializeToString(), context))

    def token_batch_entry(self, owner: str, batch: events_pb2.TokenDeltaBatch | bytes) -> Entry:
        """Return the entry that publishes every delta of `batch` to `tokens:{owner}` (field `d`, no trace context)."""
        payload = batch if isinstance(batch, bytes) else batch.SerializeToString()
        return Entry(self.key(self.tokens_stream(owner)), {TOKEN_BATCH_FIELD: payload})

    async def append(self, entries: list[Entry]) -> None:
        """Append `entries` in order, each to its stream (trimmed to about maxlen), removing from the list each one
        Redis confirmed. One server: every command written at once and the replies read in order (one round trip,
        on a connection of the bus's own); a cluster: one XADD after the other.

        Raises what Redis raises, with what it did not confirm left in `entries`, in order: after an error reply
        (e.g. WRONGTYPE), the entries it refused (those after them went in, the replies say so); after a lost
        connection, every entry from the first whose reply did not come (some may have gone in: a retry repeats
        them, which every reader of these streams tolerates)."""
        wire = self._writer
        if wire is None:
            while entries:
                await self.client.xadd(entries[0].key, entries[0].fields, maxlen=self.maxlen, approximate=True)
                del entries[0]
            return
        maxlen, head = self.maxlen, wire.xadd_head
        commands = []
        for entry in entries:
            fields = entry.fields
            commands.append(head(entry.key, maxlen, len(fields)))
            commands.append(pack_fields(fields))
        replies: list[Any] = []
        try:
            await wire.exchange(b"".join(commands), len(entries), timeout_s=self._append_timeout_s, into=replies)
        finally:
            # Confirmed: gone from the list. Refused (an error reply, the connection still in step) and not
            # answered (the connection failed first): left, in order.
            entries[:] = [*(entry for entry, reply in zip(entries, replies, strict=False)
                            if isinstance(reply, Exception)), *entries[len(replies):]]
        error = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if error is not None:
            raise error

    async def publish_kv(self, batch: events_pb2.KvEventBatch, *, context: Context | None = None) -> str:
        """Publish one replica's batch of KV events on its `kv` shard stream; return the entry id."""
        return await self.publish(self.kv_stream(batch.replica_id), batch.SerializeToString(), context=context)

    async def publish_completion(self, completion: events_pb2.Completion, *,
                                 context: Context | None = None) -> str:
        """Publish a request's terminal record on `completions`; return the entry id."""
        return await self.publish("completions", completion.SerializeToString(), context=context)

    async def publish_tokens(self, owner: str, deltas: Sequence[events_pb2.TokenDelta], *,
                             context: Context | None = None,
                             trace_fields: Sequence[Mapping[str, str]] | None = None) -> None:
        """Publish token deltas to `tokens:{owner}`, one entry each, in order, in one round trip (a script).

        `trace_fields` (one mapping per delta, from `inject_fields`) gives each delta its own request's
        trace context; otherwise every entry carries `context` (default: the current one).
        Raises ValueError when `trace_fields` does not match `deltas` in length.
        """
        if not deltas:
            return
        if trace_fields is not None and len(trace_fields) != len(deltas):
            raise ValueError(f"{len(trace_fields)} trace_fields for {len(deltas)} deltas")
        shared = inject_fields(context) if trace_fields is None else None
        args: list[Any] = [self.maxlen]
        for i, delta in enumerate(deltas):
            extra = shared if shared is not None else trace_fields[i]  # type: ignore[index]
            args.append(1 + len(extra))
            args += (PAYLOAD_FIELD, delta.SerializeToString())
            for name, value in extra.items():
                args += (name, value)
        await self._xadd_many(keys=[self.key(self.tokens_stream(owner))], args=args)

    async def publish_token_batch(self, owner: str, batch: events_pb2.TokenDeltaBatch | bytes) -> str:
        """Publish every delta of `batch` (a TokenDeltaBatch or its bytes) to `tokens:{owner}` as one entry (field
        `d`, no trace context); return the entry id. One XADD, whatever the number of requests."""
        entry = self.token_batch_entry(owner, batch)
        entry_id = await self.client.xadd(entry.key, entry.fields, maxlen=self.maxlen, approximate=True)
        return _str(entry_id)

    async def read_tokens(self, stream: str, last_id: str, *, count: int = 512,
                          block_ms: int = 200) -> list[tuple[str, list[events_pb2.TokenDelta]]]:
        """Return the entries of token stream `stream` after `last_id` as (entry id, its deltas in order), both
        entry kinds (`token_deltas_of`); [] after block_ms. An entry that does not parse is returned without
        deltas (so that the reader moves past it), counted and logged (`poison`)."""
        line = self._token_line
        if line is not None:
            entries = _raw_entries(await line.call("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS",
                                                   self.key(stream), last_id,
                                                   timeout_s=block_ms / 1000 + READ_MARGIN_S))
        else:
            entries = _entries_of(await self.client.xread({self.key(stream): last_id}, count=count, block=block_ms))
        out: list[tuple[str, list[events_pb2.TokenDelta]]] = []
        for raw_id, fields in entries:
            entry_id = _str(raw_id)
            try:
                deltas = token_deltas_of(fields or {})
            except DecodeError as exc:
                self.poison(stream, entry_id, str(exc) or "DecodeError")
                deltas = []
            out.append((entry_id, deltas))
        return out

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create consumer group `group` on `stream` (and the stream) unless it exists.

        `start_id` "0" delivers what the stream still holds; "$" only what arrives later.
        """
        try:
            await self.client.xgroup_create(self.key(stream), group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def consume(self, stream: str, group: str, consumer: str, handler: Handler, *,
                      stop: asyncio.Event, count: int = 128, block_ms: int = 200,
                      claim_idle_ms: int = 10_000, start_id: str = "0", max_attempts: int = 5,
                      min_interval_s: float = 0.0) -> None:
        """Deliver entries of `stream` to `handler(entry_id, payload, context)` until `stop` is set.

        At-least-once: an entry is acknowledged only after its handler returns. Returns when `stop` is set;
        raises what Redis raises (e.g. ConnectionError) so that the caller can restart it.
        `min_interval_s`: after a read that returned entries, the next one starts no sooner than this after it
        began, so a stream written every few milliseconds is read (and acknowledged) in batches, at the cost of
        that much delay; 0 reads again at once.
        """
        await self.ensure_group(stream, group, start_id)
        consumer_state = _ConsumerState(self, stream, group, consumer, handler, max_attempts)
        try:
            # Our own pending entries first: a restart under the same consumer name resumes them.
            await consumer_state.drain_own_pending(count)
            await self._consume(consumer_state, stream, group, stop, count, block_ms, claim_idle_ms, min_interval_s)
        finally:
            if consumer_state.line is not None:
                await consumer_state.line.close()

    async def _consume(self, consumer_state: _ConsumerState, stream: str, group: str, stop: asyncio.Event,
                       count: int, block_ms: int, claim_idle_ms: int, min_interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        next_claim = 0.0
        claim_every_s = max(claim_idle_ms / 4000.0, block_ms / 1000.0)
        next_read = 0.0
        while not stop.is_set():
            try:
                if loop.time() >= next_claim:
                    await consumer_state.autoclaim(claim_idle_ms, count)
                    next_claim = loop.time() + claim_every_s
                wait = next_read - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                began = loop.time()
                entries = await consumer_state.read(">", count, block_ms)
                next_read = began + min_interval_s if entries else 0.0
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._regroup(stream, group)
                continue
            await consumer_state.handle_entries(entries)
            if consumer_state.failures:
                # Failed entries stay in our pending list: hand them to the handler again.
                await consumer_state.drain_own_pending(count)

    async def _regroup(self, stream: str, group: str) -> None:
        """Create the group again after Redis lost it (a restarted Redis without persistence).

        From "0": everything the stream holds now was written after the restart, so none of it was seen."""
        log.warning("consumer group %s of %s is gone (Redis restarted?): creating it again", group,
                    self.key(stream))
        await self.ensure_group(stream, group, "0")

    async def ping(self, timeout_s: float = 0.5) -> bool:
        """Return True when Redis answers PING within `timeout_s` (a liveness probe; never raises)."""
        return await self.probe(timeout_s) == PING_OK

    async def probe(self, timeout_s: float = 0.5) -> str:
        """PING once: `PING_OK`, `PING_LATE` (no answer within `timeout_s`: Redis stalled, or this process's
        own event loop too busy to read the answer in time) or `PING_FAILED` (refused, reset, auth: Redis is
        not usable). Never raises."""
        try:
            return PING_OK if await asyncio.wait_for(self.client.ping(), timeout_s) else PING_FAILED
        except (TimeoutError, RedisTimeoutError):
            return PING_LATE
        except Exception:  # any other failure to answer means the bus is not usable
            return PING_FAILED

    async def read_stream(self, stream: str, last_id: str, *, count: int = 512,
                          block_ms: int = 200) -> list[tuple[str, bytes, dict[str, str]]]:
        """Return entries of `stream` after `last_id` as (entry id, payload, trace fields); [] after block_ms.

        Entries without a payload are returned with b"" so that the caller sees and reports them.
        """
        reply: Any = await self.client.xread({self.key(stream): last_id}, count=count, block=block_ms)
        out: list[tuple[str, bytes, dict[str, str]]] = []
        for entry_id, raw_fields in _entries_of(reply):
            fields: dict[Any, Any] = raw_fields or {}
            payload = fields.get(PAYLOAD_FIELD.encode(), fields.get(PAYLOAD_FIELD, b""))
            out.append((_str(entry_id), bytes(payload), _trace_fields(fields)))
        return out


class _ConsumerState:
    """One `consume` loop's bookkeeping: handling, acknowledging, failures and dead-lettering.

    The consumer's own pending list in Redis is the one record of unfinished work: failed entries stay
    there and are re-read from it, and entries claimed from dead consumers are moved there first.
    """

    def __init__(self, bus: Bus, stream: str, group: str, consumer: str, handler: Handler,
                 max_attempts: int) -> None:
        self.bus = bus
        self.stream = stream
        self.key = bus.key(stream)
        self.group = group
        self.consumer = consumer
        self.handler = handler
        self.max_attempts = max_attempts
        self.failures: dict[str, int] = {}
        self.line = bus.line()
        """This loop's own connection for its reads and acknowledgements (None on a cluster)."""

    async def read(self, last: str, count: int, block_ms: int | None = None) -> list[tuple[Any, Any]]:
        """XREADGROUP of the stream after `last` (">": entries never delivered; an id: our own pending list),
        blocking up to `block_ms` (None: not at all); the entries, fields as a dict (None: trimmed away)."""
        line = self.line
        if line is None:
            return _entries_of(await self.bus.client.xreadgroup(self.group, self.consumer, {self.key: last},
                                                                 count=count, block=block_ms))
        block = () if block_ms is None else ("BLOCK", block_ms)
        return _raw_entries(await line.call("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count,
                                            *block, "STREAMS", self.key, last,
                                            timeout_s=(block_ms or 0) / 1000 + READ_MARGIN_S))

    async def ack(self, entry_ids: Sequence[str]) -> None:
        """XACK `entry_ids` (on this loop's own connection when it has one)."""
        if self.line is None:
            await self.bus.client.xack(self.key, self.group, *entry_ids)
        else:
            await self.line.call("XACK", self.key, self.group, *entry_ids, timeout_s=READ_MARGIN_S)

    async def drain_own_pending(self, count: int) -> None:
        """Handle every entry delivered to this consumer name but not yet acknowledged, once each."""
        last = "0"
        while True:
            entries = await self.read(last, count)
            if not entries:
                return
            last = _str(entries[-1][0])
            await self.handle_entries(entries)

    async def autoclaim(self, min_idle_ms: int, count: int) -> None:
        """Move entries idle in other consumers' pending lists for over min_idle_ms to ours, then handle them.

        JUSTID, then a read of our own pending list: Redis 6.2 reports a claimed entry that was trimmed
        meanwhile without its id, while our pending list still names it (and it can be acknowledged).
        """
        claimed = 0
        for _ in range(64):  # bounded: min_idle_ms 0 would let us claim our own fresh claims forever
            # redis-py returns only the ids under JUSTID (no cursor), so each pass scans from the start;
            # what we claimed is now ours and not idle, so the next pass moves on to the rest.
            ids: Any = await self.bus.client.xautoclaim(self.key, self.group, self.consumer, min_idle_ms,
                                                   start_id="0-0", count=count, justid=True)
            claimed += len(ids)
            if len(ids) < count:
                break
        if claimed:
            log.info("claimed %d idle entries of %s for %s", claimed, self.key, self.consumer)
            await self.drain_own_pending(count)

    async def handle_entries(self, entries: Sequence[tuple[Any, Any]]) -> None:
        """Run the handler on each entry in order; acknowledge every one whose handler returned, in one XACK
        after the batch.

        One XACK per read instead of one per entry (a round trip each: most of a router's Redis commands
        were these). A process that dies before that XACK gets the batch's handled entries again from its
        pending list, as one that died between a handler and its XACK always could: handlers are idempotent.
        """
        handled: list[str] = []
        for entry_id, fields in entries:
            key = _str(entry_id)
            if await self._handle_one(key, fields):
                handled.append(key)
        if handled:
            await self.ack(handled)

    async def _handle_one(self, entry_id: str, fields: dict[Any, Any] | None) -> bool:
        """Handle one entry; True when it is to be acknowledged (handled, or trimmed away before it was)."""
        if not fields:
            # A pending entry trimmed away (MAXLEN) before anyone handled it: nothing left to handle.
            log.warning("pending entry %s of %s was trimmed before it was handled", entry_id, self.key)
            return True
        payload = fields.get(PAYLOAD_FIELD.encode())
        if payload is None:
            await self._dead_letter(entry_id, fields, f"entry has no '{PAYLOAD_FIELD}' field")
            return False
        try:
            await self.handler(entry_id, bytes(payload), extract_fields(fields))
        except DecodeError as exc:  # it will never parse: no retries, parked at once
            self.bus.poison(self.stream, entry_id, str(exc) or "DecodeError")
            await self._dead_letter(entry_id, fields, f"does not parse: {exc}")
            return False
        except Exception as exc:  # the handler's failure must not stop the loop; it is retried
            attempts = self.failures.get(entry_id, 0) + 1
            self.failures[entry_id] = attempts
            log.exception("handler failed on %s %s (attempt %d of %d)", self.key, entry_id, attempts,
                          self.max_attempts)
            if attempts >= self.max_attempts:
                await self._dead_letter(entry_id, fields, repr(exc))
            return False
        self.failures.pop(entry_id, None)
        return True

    async def _dead_letter(self, entry_id: str, fields: dict[Any, Any], error: str) -> None:
        dead: dict[Any, Any] = dict(fields)
        dead.update({b"source_id": entry_id, b"error": error, b"group": self.group})
        await self.bus.client.xadd(self.bus.key(self.stream, "dead"), dead, maxlen=self.bus.maxlen,
                                   approximate=True)
        await self.bus.client.xack(self.key, self.group, entry_id)
        self.failures.pop(entry_id, None)
        log.error("moved %s %s to %s: %s", self.key, entry_id, self.bus.key(self.stream, "dead"), error)
