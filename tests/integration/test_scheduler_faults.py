"""The scheduler's answers for faults elsewhere: Lookup (requests admission lost track of), on a real replica."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_svc.server import MAX_LOOKUP_IDS
from sluice.v1 import common_pb2, scheduler_pb2
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


def test_a_request_whose_owner_stops_renewing_its_lease_is_cancelled_owner_gone(redis_url: str,
                                                                              namespace: str) -> None:
    """A Submit naming its owner's incarnation runs while RenewLease comes (which counts the owner's requests
    here); once renewals stop, the request is cancelled within the lease and one sweep, with detail
    `owner_gone`; a request submitted without an incarnation keeps running; a bad ttl is INVALID_ARGUMENT."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True) as r:
            leased = _submit("leased", max_tokens=900)
            leased.owner_incarnation = "inc-1"
            await r.stub.Submit(leased)
            await r.stub.Submit(_submit("unleased", max_tokens=900))
            lease = scheduler_pb2.RenewLeaseRequest(owner="adm-1", owner_incarnation="inc-1", ttl_s=0.5)
            for _ in range(4):
                assert (await r.stub.RenewLease(lease)).requests == 1
                await asyncio.sleep(0.3)
            assert list((await r.stub.Lookup(scheduler_pb2.LookupRequest(request_ids=["leased"]))).live) == ["leased"]
            [ended] = await _completions(r.bus, 1, timeout=3.0)
            assert (ended.request_id, ended.status) == ("leased", common_pb2.CANCELLED)
            assert ended.detail.startswith("owner_gone")
            reply = await r.stub.Lookup(scheduler_pb2.LookupRequest(request_ids=["unleased"]))
            assert list(reply.live) == ["unleased"]
            for ttl in (0.0, -1.0, float("nan"), 301.0):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await r.stub.RenewLease(scheduler_pb2.RenewLeaseRequest(owner="a", owner_incarnation="i",
                                                                            ttl_s=ttl))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in refused.value.details()
            await r.stub.Cancel(scheduler_pb2.CancelRequest(request_id="unleased"))
    asyncio.run(body())
