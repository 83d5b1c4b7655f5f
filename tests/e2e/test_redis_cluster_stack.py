"""End to end on a real 3-node Redis Cluster: a cost-model stack (router, 2 replicas, admission) whose bus is a
`redis+cluster://` URL generates, with tokens streamed to admission and the KV events of both replicas
consumed by the router from their shard streams, nothing left pending."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice import client as sdk
from sluice.bus import Bus, redis_client
from sluice.redis_server import EmbeddedRedisCluster
from sluice.v1 import events_pb2
from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(240)]
PROMPT = list(range(1, 97))  # 6 full blocks of 16: each replica that serves it stores KV blocks


async def _kv_state(url: str, namespace: str, group: str, replicas: list[str]) -> dict[str, tuple[int, int, int]]:
    """Return replica -> (KV batches on its shard stream, its STORED events, entries pending for the router);
    asserts that each STORED event has vLLM's fields as the stack's flags set them."""
    client = redis_client(url)
    bus = Bus(client, namespace)
    out = {}
    try:
        for replica_id in replicas:
            key = bus.key(bus.kv_stream(replica_id))
            batches = [events_pb2.KvEventBatch.FromString(fields[b"p"]) for _, fields in await client.xrange(key)]
            mine = [b for b in batches if b.replica_id == replica_id]
            events = [e.block_stored for b in mine for e in b.events if e.WhichOneof("kind") == "block_stored"]
            for event in events:
                assert (event.block_size, event.medium) == (16, "GPU"), event
                assert len(event.token_ids) == 16 * len(event.block_hashes), "--kv-event-token-ids sends tokens"
            assert all(b.ts > 1e9 for b in mine), "batches carry a Unix timestamp"
            stored = len(events)
            pending = (await client.xpending(key, group))["pending"]
            out[replica_id] = (len(mine), stored, pending)
    finally:
        await client.aclose()
    return out


def test_costmodel_stack_generates_over_a_redis_cluster(tmp_path: Path) -> None:
    """Requests complete with every token through the cluster, and the router consumed both replicas' KV
    events (vLLM-shaped: block size 16, medium GPU, token ids as asked, a timestamp) from the shard streams
    with nothing pending."""
    with EmbeddedRedisCluster(3) as cluster:
        config = StackConfig(replicas=2, backend="costmodel", model="llama-3-8b", run_dir=tmp_path,
                             redis_url=cluster.url, num_blocks=512, scheduler_args=("--kv-event-token-ids",))
        with Stack(config) as stack:
            assert stack.redis is None, "the stack used the cluster, not an embedded server"
            with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
                for i in range(8):
                    result = client.generate_text([*PROMPT, 200 + i], max_tokens=8)
                    assert len(result.token_ids) == 8
            replicas = ["replica-0", "replica-1"]
            group = f"router:router-{config.namespace}"
            state: dict[str, tuple[int, int, int]] = {}
            for _ in range(100):
                state = asyncio.run(_kv_state(cluster.url, config.namespace, group, replicas))
                if any(stored for _, stored, _ in state.values()) and all(p == 0 for _, _, p in state.values()):
                    break
                asyncio.run(asyncio.sleep(0.1))
            assert sum(stored for _, stored, _ in state.values()) >= 6, state
            assert all(pending == 0 for _, _, pending in state.values()), state
