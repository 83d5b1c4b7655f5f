"""KV events linger in the publisher (--kv-linger-ms): rounds' events merge into one `kv` entry, in order, and go out
when the linger ends, with a completion, on a flush or on stopping. Real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from opentelemetry.context import Context

from scheduler_svc.__main__ import kv_linger_seconds, parse_args
from scheduler_svc.publisher import Outgoing, Publisher
from sluice.bus import PAYLOAD_FIELD, Bus, redis_client
from sluice.serve import StartupError
from sluice.v1 import events_pb2

pytestmark = pytest.mark.redis

REPLICA = "replica-l"


def _kv(*event_ids: int) -> Outgoing:
    batch = events_pb2.KvEventBatch(replica_id=REPLICA)
    for event_id in event_ids:
        batch.events.add(event_id=event_id).block_stored.block_hashes.append(event_id)
    return Outgoing(kv=batch)


def _completion(request_id: str) -> Outgoing:
    return Outgoing(completions=[(events_pb2.Completion(request_id=request_id, replica_id=REPLICA), Context())])


async def _kv_entries(bus: Bus) -> list[list[int]]:
    """The event ids of each entry of the replica's kv stream, in order."""
    entries: Any = await bus.client.xrange(bus.key(bus.kv_stream(REPLICA)))
    return [[e.event_id for e in events_pb2.KvEventBatch.FromString(fields[PAYLOAD_FIELD.encode()]).events]
            for _, fields in entries]


def _scenario(redis_url: str, namespace: str, linger_s: float,
              body: Callable[[Bus, Publisher, list[int]], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        bus = Bus(redis_client(redis_url), namespace)
        sizes: list[int] = []
        publisher = Publisher(bus, kv_linger_s=linger_s, on_kv_entry=sizes.append)
        task = asyncio.create_task(publisher.run())
        try:
            return await body(bus, publisher, sizes)
        finally:
            await publisher.close()
            await publisher.wait_closed(task, grace_s=30.0)
            await bus.client.aclose()

    return asyncio.run(run())


def test_rounds_events_linger_and_a_completion_takes_them_out_merged(redis_url: str, namespace: str) -> None:
    """Within the linger no KV entry goes out; the next completion publishes every lingering event as one entry, in
    the order the rounds made them, and the metric hook sees that one entry."""
    async def body(bus: Bus, publisher: Publisher, sizes: list[int]) -> tuple[list[list[int]], list[list[int]], Any]:
        for first in (1, 3, 5, 7):
            publisher.put(_kv(first, first + 1))
            await publisher._outbox.join()  # each round's batch handled on its own, as rounds come
        held = await _kv_entries(bus)
        publisher.put(_completion("done"))
        await publisher._outbox.join()
        return held, await _kv_entries(bus), list(sizes)

    held, published, sizes = _scenario(redis_url, namespace, 30.0, body)
    assert held == []
    assert published == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert sizes == [8]


def test_lingering_events_go_out_when_the_linger_ends(redis_url: str, namespace: str) -> None:
    """With nothing else published, the lingering events go out on their own once the linger has passed (not
    before it)."""
    async def body(bus: Bus, publisher: Publisher, sizes: list[int]) -> tuple[list[list[int]], float]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        publisher.put(_kv(1))
        publisher.put(_kv(2))
        while not await _kv_entries(bus):
            assert loop.time() - began < 30, "the lingering events never went out"
            await asyncio.sleep(0.01)
        return await _kv_entries(bus), loop.time() - began

    published, after_s = _scenario(redis_url, namespace, 0.2, body)
    assert published == [[1, 2]]
    assert after_s >= 0.19


@pytest.mark.parametrize("how", ["flush", "flush_at_once", "close"])
def test_a_flush_or_stopping_publishes_the_lingering_events(redis_url: str, namespace: str, how: str) -> None:
    """A drain's flush (True: all handed to Redis) and stopping publish lingering events at once, whatever is left
    of the linger; so does a flush called while the events are still queued (not lingering yet)."""
    async def body(bus: Bus, publisher: Publisher, sizes: list[int]) -> list[list[int]]:
        publisher.put(_kv(1))
        if how == "flush_at_once":
            assert await publisher.flush(grace_s=30.0)
            return await _kv_entries(bus)
        await publisher._outbox.join()
        assert await _kv_entries(bus) == []
        if how == "flush":
            assert await publisher.flush(grace_s=30.0)
        else:
            await publisher.close()
            await publisher._outbox.join()
        return await _kv_entries(bus)

    assert _scenario(redis_url, namespace, 30.0, body) == [[1]]


def test_without_a_linger_each_publication_has_its_own_entry(redis_url: str, namespace: str) -> None:
    async def body(bus: Bus, publisher: Publisher, sizes: list[int]) -> list[list[int]]:
        for event_id in (1, 2, 3):
            publisher.put(_kv(event_id))
            await publisher._outbox.join()
        return await _kv_entries(bus)

    assert _scenario(redis_url, namespace, 0.0, body) == [[1], [2], [3]]


@pytest.mark.parametrize("linger_ms", ["-1", "nan", "inf"])
def test_a_negative_or_not_finite_linger_is_refused_naming_it(linger_ms: str) -> None:
    """The flag stops the scheduler at start naming it (before it waits for its worker); the publisher refuses
    such a linger too."""
    with pytest.raises(StartupError, match="--kv-linger-ms"):
        kv_linger_seconds(parse_args(["--replica-id", "r", "--kv-linger-ms", linger_ms]))
    with pytest.raises(ValueError, match="kv_linger_s"):
        Publisher(None, kv_linger_s=float(linger_ms) / 1000)  # type: ignore[arg-type]
    assert kv_linger_seconds(parse_args(["--replica-id", "r", "--kv-linger-ms", "20"])) == 0.02
