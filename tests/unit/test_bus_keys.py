"""Bus key names: one Redis Cluster hash tag per stream (its dead letters in its slot), a stable KV shard per
replica, and namespaces that cannot break the tag."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from sluice.bus import Bus, split_cluster_url


def _bus(**kwargs: object) -> Bus:
    # A client that never connects: naming keys needs no server.
    return Bus(aioredis.Redis(), "prod", **kwargs)  # type: ignore[arg-type]


def test_keys_carry_one_hash_tag_per_stream() -> None:
    """A stream's key is sluice:{namespace:stream}; its dead-letter key shares the tag and so the slot."""
    bus = _bus()
    assert bus.key("kv:3") == "sluice:{prod:kv:3}"
    assert bus.key("tokens:adm-1", "dead") == "sluice:{prod:tokens:adm-1}:dead"
    assert key_slot(bus.key("completions", "dead").encode()) == key_slot(bus.key("completions").encode())
    assert key_slot(bus.key("kv:0").encode()) != key_slot(bus.key("kv:1").encode())


def test_each_replica_has_one_stable_shard_and_shards_cover_the_range() -> None:
    """kv_stream is a function of the replica id alone, within kv_streams; 64 replicas use all 4 shards."""
    bus = _bus(kv_shards=4)
    assert bus.kv_streams() == ["kv:0", "kv:1", "kv:2", "kv:3"]
    shards = {bus.kv_stream(f"replica-{i}") for i in range(64)}
    assert shards == set(bus.kv_streams())
    assert _bus(kv_shards=4).kv_stream("replica-7") == bus.kv_stream("replica-7")
    assert _bus(kv_shards=1).kv_streams() == ["kv:0"]


@pytest.mark.parametrize("namespace", ["", "a:b", "a{b", "a}b"])
def test_namespace_that_would_break_the_key_or_tag_is_refused(namespace: str) -> None:
    """A namespace with ':' or a brace (which would move the hash tag) is a ValueError naming it."""
    with pytest.raises(ValueError, match="namespace"):
        Bus(aioredis.Redis(), namespace)


def test_kv_shards_must_be_positive() -> None:
    """Zero KV shards is refused."""
    with pytest.raises(ValueError, match="kv_shards"):
        _bus(kv_shards=0)


def test_cluster_schemes_are_made_plain_for_redis_py() -> None:
    """redis+cluster:// and rediss+cluster:// name a cluster and keep the rest of the URL; others do not."""
    assert split_cluster_url("redis+cluster://:pw@h:7000/0") == ("redis://:pw@h:7000/0", True)
    assert split_cluster_url("rediss+cluster://h:7000/0?ssl_ca_certs=/ca.pem") == (
        "rediss://h:7000/0?ssl_ca_certs=/ca.pem", True)
    assert split_cluster_url("redis://h:6379/0") == ("redis://h:6379/0", False)
