"""The scheduler's answers for faults elsewhere: Lookup (requests admission lost track of), on a real replica."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_svc.server import MAX_LOOKUP_IDS
from sluice.v1 import scheduler_pb2
from tests.integration.test_scheduler_svc import _completions, _replica, _submit

pytestmark = pytest.mark.redis


def test_lookup_names_live_requests_and_returns_the_completions_of_ended_ones(redis_url: str, namespace: str) -> None:
    """Lookup says which ids are queued or running, returns the very completion the replica published for one
    that ended (so a completion lost on the bus can be fetched again), omits ids it never held, and refuses
    more than MAX_LOOKUP_IDS ids with INVALID_ARGUMENT naming the field."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True) as r:
            await r.stub.Submit(_submit("short", max_tokens=4))
            [published] = await _completions(r.bus, 1)
            await r.stub.Submit(_submit("long", max_tokens=900))
            reply = await r.stub.Lookup(scheduler_pb2.LookupRequest(request_ids=["short", "long", "never"]))
            assert list(reply.live) == ["long"]
            assert [c.SerializeToString() for c in reply.recent] == [published.SerializeToString()]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await r.stub.Lookup(scheduler_pb2.LookupRequest(request_ids=["x"] * (MAX_LOOKUP_IDS + 1)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_ids" in refused.value.details()
            await r.stub.Cancel(scheduler_pb2.CancelRequest(request_id="long"))
    asyncio.run(body())
