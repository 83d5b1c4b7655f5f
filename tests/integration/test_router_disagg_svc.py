"""The router gRPC service with prefill and decode replicas: the pair in RouteResponse and in the "routed" span."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from sluice.errors import details_of
from sluice.telemetry import get_tracer, inject_metadata
from sluice.types import KV_HELD
from sluice.v1 import events_pb2, router_pb2
from tests.integration.test_router_svc import Harness, _router, _until

pytestmark = pytest.mark.redis


async def _register_role(h: Harness, replica_id: str, role: int) -> None:
    await h.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=router_pb2.Replica(
        replica_id=replica_id, model="m", scheduler_address=h.sources[replica_id][1], block_size=16,
        num_blocks=1000, prefill_tokens_per_s=16_000.0, decode_round_s=0.01, role=role, incarnation=f"i-{replica_id}")))
    await h.stub.Heartbeat(router_pb2.HeartbeatRequest(
        replica_id=replica_id, state=router_pb2.READY, load=router_pb2.ReplicaLoad(kv_blocks_free=1000)))


def test_route_answers_the_pair_and_traces_it(redis_url: str, namespace: str,
                                             span_exporter) -> None:  # type: ignore[no-untyped-def]
    """With a prefill and a decode replica registered, Route names the prefill replica as the replica and the decode
    one in the decode fields; ListReplicas carries the roles; the "routed" span has both ids; the decode claim
    outlives the prefill half's KV_HELD completion and ends with the decode half's."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("P", "D")) as h:
            await _register_role(h, "P", router_pb2.REPLICA_ROLE_PREFILL)
            await _register_role(h, "D", router_pb2.REPLICA_ROLE_DECODE)
            listed = await h.stub.ListReplicas(router_pb2.ListReplicasRequest())
            assert {r.replica_id: r.role for r in listed.replicas} == {
                "P": router_pb2.REPLICA_ROLE_PREFILL, "D": router_pb2.REPLICA_ROLE_DECODE}
            with get_tracer("test").start_as_current_span("admission"):
                reply = await h.stub.Route(router_pb2.RouteRequest(request_id="t1", model="m", prompt_tokens=100,
                                                                   max_tokens=10), metadata=inject_metadata())
            assert (reply.replica_id, reply.decode_replica_id) == ("P", "D")
            assert reply.decode_scheduler_address == h.sources["D"][1] and reply.decode_incarnation == "i-D"
            routed = [s for s in span_exporter.get_finished_spans() if s.name == "routed"]
            assert routed[0].attributes["sluice.prefill_replica_id"] == "P"
            assert routed[0].attributes["sluice.decode_replica_id"] == "D"
            assert routed[0].attributes["sluice.kv_transfer"] is True
            assert "t1" in h.runtime.pairs.claims["D"].claims
            assert h.runtime.metrics.registry.get_sample_value("sluice_router_decode_routes_total",
                                                                {"replica": "D"}) == 1.0
            # the prefill half's completion (its KV held for the hand-off) leaves the decode claim standing ...
            await h.bus.publish_completion(events_pb2.Completion(request_id="t1", replica_id="P", detail=KV_HELD))
            await _until(lambda: "t1" not in h.runtime.core.fleet.find("P").inflight)
            assert "t1" in h.runtime.pairs.claims["D"].claims
            # ... the decode half's (a later attempt, published by the decode replica) releases it
            await h.bus.publish_completion(events_pb2.Completion(request_id="t1#1", replica_id="D"))
            await _until(lambda: "D" not in h.runtime.pairs.claims)
    asyncio.run(body())


def test_an_aggregated_fleet_answers_no_decode_replica(redis_url: str, namespace: str) -> None:
    """Replicas registered without a role are BOTH: Route answers one replica and empty decode fields."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",)) as h:
            await _register_role(h, "A", router_pb2.REPLICA_ROLE_BOTH)
            reply = await h.stub.Route(router_pb2.RouteRequest(request_id="t1", model="m", prompt_tokens=100))
            assert (reply.replica_id, reply.decode_replica_id) == ("A", "")
    asyncio.run(body())


def test_an_unknown_role_is_refused_naming_the_field(redis_url: str, namespace: str) -> None:
    """RegisterReplica with a role value the enum does not have answers INVALID_ARGUMENT naming replica.role."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",)) as h:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=router_pb2.Replica(
                    replica_id="A", model="m", block_size=16, num_blocks=10, role=9)))  # type: ignore[arg-type]
            details = details_of(err.value)
            assert (details.code, details.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "replica.role")
    asyncio.run(body())
