"""The router gRPC service on loopback with a real Redis: routing, replica states, the KV index, tracing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router_svc.core import RouterConfig, RouterCore
from router_svc.server import RouterRuntime, start_router_server
from sluice.bus import Bus
from sluice.errors import details_of
from sluice.telemetry import get_tracer, inject_metadata
from sluice.v1 import common_pb2, events_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.redis

PREFIX = [1000 + i for i in range(40)]  # the block-hash chain of a 640-token prompt


@dataclass
class SnapshotSource(scheduler_pb2_grpc.SchedulerServiceServicer):
    """The KvSnapshot RPC of a replica's scheduler, answering from a cache state the test controls."""

    replica_id: str
    last_event_id: int = 0
    hashes: list[int] = field(default_factory=list)
    calls: int = 0

    async def KvSnapshot(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        return scheduler_pb2.KvSnapshotResponse(replica_id=self.replica_id, last_event_id=self.last_event_id,
                                                block_hashes=self.hashes)


@dataclass
class Harness:
    runtime: RouterRuntime
    stub: router_pb2_grpc.RouterServiceStub
    bus: Bus
    sources: dict[str, tuple[SnapshotSource, str]]
    stub_channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def _sources(replicas: tuple[str, ...]) -> AsyncIterator[dict[str, tuple[SnapshotSource, str]]]:
    """A real gRPC server answering KvSnapshot for each replica id: replica id -> (source, address)."""
    sources: dict[str, tuple[SnapshotSource, str]] = {}
    servers = []
    for replica_id in replicas:
        source = SnapshotSource(replica_id)
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(source, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        sources[replica_id] = (source, f"127.0.0.1:{port}")
    try:
        yield sources
    finally:
        for server in servers:
            await server.stop(0)


@contextlib.asynccontextmanager
async def _router(redis_url: str, namespace: str, replicas: tuple[str, ...] = ("A", "B"),
                  config: RouterConfig | None = None,
                  sources: dict[str, tuple[SnapshotSource, str]] | None = None) -> AsyncIterator[Harness]:
    """A router with real Redis and a KvSnapshot server per replica id (reused when `sources` is given)."""
    async with contextlib.AsyncExitStack() as stack:
        if sources is None:
            sources = await stack.enter_async_context(_sources(replicas))
        client = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(client.aclose)
        bus = Bus(client, namespace)
        runtime = RouterRuntime(RouterCore(config or RouterConfig()), bus, "r1")
        server, port = await start_router_server(runtime)
        stack.push_async_callback(server.stop, 0)
        stop = asyncio.Event()
        loop_task = asyncio.create_task(runtime.run(stop, expiry_interval_s=0.1, block_ms=20))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stack.push_async_callback(channel.close)
        try:
            yield Harness(runtime, router_pb2_grpc.RouterServiceStub(channel), bus, sources, channel)
        finally:
            stop.set()
            await asyncio.wait_for(loop_task, 5)


async def _register(h: Harness, replica_id: str, model: str = "m", ready: bool = True,
                    queued_prefill_tokens: int = 0) -> None:
    address = h.sources[replica_id][1] if replica_id in h.sources else ""
    await h.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=router_pb2.Replica(
        replica_id=replica_id, model=model, scheduler_address=address, block_size=16, num_blocks=1000,
        prefill_tokens_per_s=16_000.0, decode_round_s=0.01)))
    if ready:
        await _heartbeat(h, replica_id, router_pb2.READY, queued_prefill_tokens)


async def _heartbeat(h: Harness, replica_id: str, state: int, queued_prefill_tokens: int = 0) -> int:
    reply = await h.stub.Heartbeat(router_pb2.HeartbeatRequest(
        replica_id=replica_id, state=state,
        load=router_pb2.ReplicaLoad(queued_prefill_tokens=queued_prefill_tokens, kv_blocks_free=500)))
    return int(reply.state)


async def _publish(bus: Bus, replica_id: str, first_id: int, hashes: list[int]) -> None:
    batch = events_pb2.KvEventBatch(replica_id=replica_id)
    for i, block_hash in enumerate(hashes):
        batch.events.add(event_id=first_id + i).block_stored.block_hashes.append(block_hash)
    await bus.publish_kv(batch)


async def _until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _route(h: Harness, request_id: str, model: str = "m", hashes: list[int] = PREFIX):  # type: ignore[no-untyped-def]
    return h.stub.Route(router_pb2.RouteRequest(request_id=request_id, model=model, block_hashes=hashes,
                                                prompt_tokens=16 * len(hashes), max_tokens=16))


def test_design_example_queue_outweighs_prefix_reuse(redis_url: str, namespace: str) -> None:
    """DESIGN.md's example: A saves 20 ms of prefill by prefix reuse but has 50 ms of queue, B has no prefix
    and 5 ms of queue, so B is chosen; with A's queue gone, the prefix wins and A is chosen."""
    async def body() -> None:
        async with _router(redis_url, namespace, config=RouterConfig(prediction_ttl_s=0)) as h:
            await _register(h, "A", queued_prefill_tokens=800)  # 800 tokens / 16k tok/s = 50 ms
            await _register(h, "B", queued_prefill_tokens=80)   # 5 ms
            await _publish(h.bus, "A", 1, PREFIX[:20])          # 20 blocks * 16 tokens = 320 tokens = 20 ms
            await _until(lambda: h.runtime.core.cached_blocks("A", PREFIX, 0) == 20)
            chosen = await _route(h, "req-1")
            assert chosen.replica_id == "B" and chosen.cached_blocks == 0
            assert chosen.predicted_ttft_s == pytest.approx(0.005 + 0.040)
            await _heartbeat(h, "A", router_pb2.READY, queued_prefill_tokens=0)
            await _heartbeat(h, "B", router_pb2.READY, queued_prefill_tokens=80)
            chosen = await _route(h, "req-2")
            assert chosen.replica_id == "A" and chosen.cached_blocks == 20
    asyncio.run(body())


def test_a_dry_run_route_answers_like_a_route_and_leaves_nothing_behind(redis_url: str, namespace: str) -> None:
    """Over gRPC, RouteRequest.dry_run gets the choice and prediction a route would, but the replica shows no
    request in flight afterwards and the probe is counted as a dry run, not as a route."""
    async def body() -> None:
        async with _router(redis_url, namespace, config=RouterConfig(prediction_ttl_s=0)) as h:
            await _register(h, "A", queued_prefill_tokens=0)
            await _register(h, "B", queued_prefill_tokens=800)
            for i in range(5):
                probe = await h.stub.Route(router_pb2.RouteRequest(request_id=f"p{i}", model="m", block_hashes=PREFIX,
                                                                   prompt_tokens=16 * len(PREFIX), dry_run=True))
                assert probe.replica_id == "A"
            assert [view.inflight for view in h.runtime.core.replicas()] == [0, 0]
            routed = await _route(h, "real")
            assert (routed.replica_id, routed.predicted_ttft_s) == ("A", probe.predicted_ttft_s)
            metrics = h.runtime.metrics.registry
            assert metrics.get_sample_value("sluice_route_dry_runs_total") == 5
            assert metrics.get_sample_value("sluice_routes_total", {"replica": "A"}) == 1
    asyncio.run(body())


def test_an_idle_report_forgets_a_route_that_never_arrived_and_counts_it(redis_url: str, namespace: str) -> None:
    """A request routed but never submitted (its caller gone) stops counting on its replica at the first idle report
    over a heartbeat timeout later, and sluice_router_stale_routes_total counts it."""
    async def body() -> None:
        async with _router(redis_url, namespace, config=RouterConfig(heartbeat_timeout_s=1.0)) as h:
            await _register(h, "A")
            await _route(h, "orphan")
            assert [view.inflight for view in h.runtime.core.replicas()] == [1]
            for _ in range(5):  # busy reports keep it, and keep the replica alive past the timeout
                await h.stub.Heartbeat(router_pb2.HeartbeatRequest(
                    replica_id="A", state=router_pb2.READY, load=router_pb2.ReplicaLoad(waiting=1)))
                await asyncio.sleep(0.3)
            assert [view.inflight for view in h.runtime.core.replicas()] == [1]
            await _heartbeat(h, "A", router_pb2.READY)
            assert [view.inflight for view in h.runtime.core.replicas()] == [0]
            assert h.runtime.metrics.registry.get_sample_value("sluice_router_stale_routes_total") == 1
    asyncio.run(body())


def test_a_rejected_completion_takes_back_the_routes_predicted_blocks(redis_url: str, namespace: str) -> None:
    """Over the completions stream: a FINISHED completion leaves the route's predicted prefix in place (the request
    ran there); a REJECTED one (refused after routing) takes it back at once, and
    sluice_router_predictions_retracted_total counts it."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",)) as h:
            await _register(h, "A")
            await _route(h, "ran")
            await _route(h, "refused", hashes=PREFIX[:30] + [9000 + i for i in range(5)])
            core, metrics = h.runtime.core, h.runtime.metrics.registry
            assert core.cached_blocks("A", PREFIX, 0) == 40
            await h.bus.publish_completion(events_pb2.Completion(request_id="ran", replica_id="A",
                                                                 status=common_pb2.FINISHED_LENGTH))
            await _until(lambda: [view.inflight for view in core.replicas()] == [1])
            assert core.cached_blocks("A", PREFIX, 0) == 40
            await h.bus.publish_completion(events_pb2.Completion(request_id="refused", replica_id="A",
                                                                 status=common_pb2.REJECTED))
            await _until(lambda: [view.inflight for view in core.replicas()] == [0])
            assert core.cached_blocks("A", PREFIX, 0) == 40  # "ran"'s own prediction, not the refused one's
            assert core.cached_blocks("A", PREFIX[:30] + [9000], 0) == 30
            assert metrics.get_sample_value("sluice_router_predictions_retracted_total") == 1
    asyncio.run(body())


def test_only_ready_compatible_replicas_get_traffic(redis_url: str, namespace: str) -> None:
    """The router reports SERVING over gRPC health; WARMING replicas and replicas of another model get no
    requests; with no READY replica Route is UNAVAILABLE, and for a model nobody serves it is NOT_FOUND."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("warm", "ready", "other")) as h:
            health = await health_pb2_grpc.HealthStub(h.stub_channel).Check(
                health_pb2.HealthCheckRequest(service="sluice.v1.RouterService"))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            await _register(h, "warm", ready=False)
            await _register(h, "ready")
            await _register(h, "other", model="m2")
            chosen = {(await _route(h, f"q{i}")).replica_id for i in range(10)}
            assert chosen == {"ready"}
            await h.stub.Drain(router_pb2.DrainRequest(replica_id="ready"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _route(h, "q-none")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert details_of(err.value).reason == "no_ready_replica"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _route(h, "q-unknown", model="nobody-serves-this")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    asyncio.run(body())


def test_a_draining_replica_gets_no_new_requests(redis_url: str, namespace: str) -> None:
    """After a replica heartbeats DRAINING, every request goes to the other READY replica, even one whose
    prefix is cached only on the draining replica; ListReplicas shows it DRAINING."""
    async def body() -> None:
        async with _router(redis_url, namespace) as h:
            await _register(h, "A")
            await _register(h, "B")
            await _publish(h.bus, "A", 1, PREFIX)
            await _until(lambda: h.runtime.core.cached_blocks("A", PREFIX, 0) == 40)
            assert await _heartbeat(h, "A", router_pb2.DRAINING) == router_pb2.DRAINING
            assert {(await _route(h, f"q{i}")).replica_id for i in range(10)} == {"B"}
            listed = await h.stub.ListReplicas(router_pb2.ListReplicasRequest())
            assert {r.replica_id: r.state for r in listed.replicas} == {
                "A": router_pb2.DRAINING, "B": router_pb2.READY}
    asyncio.run(body())


def test_an_unhealthy_replica_gets_no_traffic_until_it_reports_ready_again(redis_url: str, namespace: str) -> None:
    """A READY replica that heartbeats UNHEALTHY (its worker is down) is listed UNHEALTHY and gets no requests,
    even for a prefix only it holds; with no other replica Route is UNAVAILABLE; READY again restores it."""
    async def body() -> None:
        async with _router(redis_url, namespace) as h:
            await _register(h, "A")
            await _register(h, "B")
            await _publish(h.bus, "A", 1, PREFIX)
            await _until(lambda: h.runtime.core.cached_blocks("A", PREFIX, 0) == 40)
            assert (await _route(h, "q-before")).replica_id == "A"
            assert await _heartbeat(h, "A", router_pb2.UNHEALTHY) == router_pb2.UNHEALTHY
            assert {(await _route(h, f"q{i}")).replica_id for i in range(10)} == {"B"}
            listed = await h.stub.ListReplicas(router_pb2.ListReplicasRequest())
            assert {r.replica_id: r.state for r in listed.replicas} == {
                "A": router_pb2.UNHEALTHY, "B": router_pb2.READY}
            assert await _heartbeat(h, "B", router_pb2.UNHEALTHY) == router_pb2.UNHEALTHY
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _route(h, "q-none")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unhealthy" in (err.value.details() or "")
            assert await _heartbeat(h, "A", router_pb2.READY) == router_pb2.READY
            assert (await _route(h, "q-after")).replica_id == "A"
            # A draining replica whose worker then fails stays DRAINING (it is leaving anyway).
            assert await _heartbeat(h, "A", router_pb2.DRAINING) == router_pb2.DRAINING
            assert await _heartbeat(h, "A", router_pb2.UNHEALTHY) == router_pb2.DRAINING
    asyncio.run(body())


def test_measured_rates_in_heartbeats_replace_the_registered_ones(redis_url: str, namespace: str) -> None:
    """The TTFT prediction uses the prefill rate and decode round a heartbeat measured, and falls back to
    the registered ones when a heartbeat carries none (0)."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",), config=RouterConfig(prediction_ttl_s=0)) as h:
            await _register(h, "A")  # registered: 16k tokens/s
            assert (await _route(h, "q1")).predicted_ttft_s == pytest.approx(640 / 16_000)
            await h.stub.Heartbeat(router_pb2.HeartbeatRequest(
                replica_id="A", state=router_pb2.READY,
                load=router_pb2.ReplicaLoad(running=1, prefill_tokens_per_s=3_200.0, decode_round_s=0.05)))
            # 640 uncached tokens at 3200 tok/s, plus one measured decode round of interference (one chunk),
            # plus 1.5 measured decode rounds in flight (pipelining: the queue is empty, the rounds are decodes).
            assert (await _route(h, "q2")).predicted_ttft_s == pytest.approx(640 / 3_200 + 0.05 + 1.5 * 0.05)
            await _heartbeat(h, "A", router_pb2.READY)
            # q1 and q2 are routed here, not done: busy, so 1.5 registered decode rounds in flight.
            assert (await _route(h, "q3")).predicted_ttft_s == pytest.approx(640 / 16_000 + 0.01 + 1.5 * 0.01)
    asyncio.run(body())


def test_restarted_router_rebuilds_its_index_from_snapshot_and_stream(redis_url: str, namespace: str) -> None:
    """A router restarted mid-run learns the replica's cache from a KvSnapshot when the replica re-registers
    (its heartbeat is NOT_FOUND first) and then from KV events published after the snapshot."""
    async def body() -> None:
        async with _sources(("A",)) as sources:
            async with _router(redis_url, namespace, sources=sources) as first:
                await _register(first, "A")
                await _publish(first.bus, "A", 1, PREFIX[:10])
                await _until(lambda: first.runtime.core.cached_blocks("A", PREFIX, 0) == 10)
            source = sources["A"][0]
            source.last_event_id, source.hashes = 25, PREFIX[:25]  # the replica's cache while no router ran
            client = aioredis.Redis.from_url(redis_url)
            await _publish(Bus(client, namespace), "A", 11, PREFIX[10:25])
            await client.aclose()
            async with _router(redis_url, namespace, sources=sources) as second:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _heartbeat(second, "A", router_pb2.READY)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                await _register(second, "A")
                await _until(lambda: second.runtime.core.cached_blocks("A", PREFIX, 0) == 25)
                await _publish(second.bus, "A", 26, PREFIX[25:])
                await _until(lambda: second.runtime.core.cached_blocks("A", PREFIX, 0) == 40)
                assert (await _route(second, "after-restart")).cached_blocks == 40
    asyncio.run(body())


def test_an_event_id_gap_triggers_a_snapshot(redis_url: str, namespace: str) -> None:
    """KV events that skip event ids make the router fetch a KvSnapshot and adopt it, instead of
    indexing a cache it has only partly seen."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",)) as h:
            await _register(h, "A")
            source = h.sources["A"][0]
            await _until(lambda: source.calls == 1)  # the registration snapshot
            await _publish(h.bus, "A", 1, PREFIX[:3])
            await _until(lambda: h.runtime.core.cached_blocks("A", PREFIX, 0) == 3)
            source.last_event_id, source.hashes = 30, PREFIX[:30]
            await _publish(h.bus, "A", 30, [PREFIX[29]])  # ids 4..29 never arrive
            await _until(lambda: h.runtime.core.cached_blocks("A", PREFIX, 0) == 30)
            assert source.calls == 2
    asyncio.run(body())


def test_a_silent_replica_goes_and_is_purged(redis_url: str, namespace: str) -> None:
    """A replica that stops heartbeating is GONE after the timeout: no longer listed, its prefixes unindexed."""
    async def body() -> None:
        async with _router(redis_url, namespace, config=RouterConfig(heartbeat_timeout_s=0.3)) as h:
            await _register(h, "A")
            await _publish(h.bus, "A", 1, PREFIX[:5])
            await _until(lambda: h.runtime.core.indexed_blocks == 5)
            await _until(lambda: not h.runtime.core.replicas(), timeout=3)
            assert h.runtime.core.indexed_blocks == 0
            assert not (await h.stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
    asyncio.run(body())


def test_route_records_a_routed_span_in_the_callers_trace(redis_url: str, namespace: str,
                                                          span_exporter) -> None:  # type: ignore[no-untyped-def]
    """Route continues the trace context sent in gRPC metadata with a "routed" span naming the replica."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",)) as h:
            await _register(h, "A")
            with get_tracer("test").start_as_current_span("admission") as parent:
                await h.stub.Route(router_pb2.RouteRequest(request_id="t1", model="m", prompt_tokens=10),
                                   metadata=inject_metadata())
            routed = [s for s in span_exporter.get_finished_spans() if s.name == "routed"]
            assert len(routed) == 1
            assert routed[0].context.trace_id == parent.get_span_context().trace_id
            assert routed[0].parent.span_id == parent.get_span_context().span_id
            assert routed[0].attributes["sluice.replica_id"] == "A"
    asyncio.run(body())


def _closed_port_address() -> str:
    """Return a loopback address nothing listens on (a port bound once, then closed)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_report_unreachable_takes_out_a_dead_scheduler_and_nothing_else(redis_url: str, namespace: str) -> None:
    """A ReportUnreachable whose probe is refused makes the replica UNHEALTHY at once (traffic goes to the
    other) until it heartbeats READY; a report about a scheduler that answers, about another address or
    about an unknown replica changes nothing; each outcome is counted."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=("A",)) as h:
            await _register(h, "A")
            dead = _closed_port_address()
            await h.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=router_pb2.Replica(
                replica_id="D", model="m", scheduler_address=dead, block_size=16, num_blocks=1000)))
            await _heartbeat(h, "D", router_pb2.READY)

            def report(replica_id: str, address: str):  # type: ignore[no-untyped-def]
                return h.stub.ReportUnreachable(router_pb2.ReportUnreachableRequest(
                    replica_id=replica_id, scheduler_address=address, detail="UNAVAILABLE: refused"))

            assert (await report("A", h.sources["A"][1])).state == router_pb2.READY      # it answers: refuted
            assert (await report("D", "127.0.0.1:1")).state == router_pb2.READY          # not D's address
            assert (await report("X", dead)).state == router_pb2.GONE                    # unknown replica
            assert (await report("D", dead)).state == router_pb2.UNHEALTHY               # probe refused too
            routed = {(await _route(h, f"r{i}", hashes=[i])).replica_id for i in range(8)}
            assert routed == {"A"}
            assert await _heartbeat(h, "D", router_pb2.READY) == router_pb2.READY    # alive after all: back
            outcomes = h.runtime.metrics.unreachable_reports
            assert [outcomes.labels(o)._value.get() for o in ("confirmed", "refuted", "unknown")] == [1, 1, 2]
    asyncio.run(body())


def test_a_scheduler_back_on_its_address_is_not_taken_out_by_a_later_report(redis_url: str, namespace: str) -> None:
    """After a confirmed report, the scheduler comes back on the same address: a new report is refuted at once
    (each probe dials afresh; a channel still backing off from the first failure would confirm it again)."""
    async def body() -> None:
        async with _router(redis_url, namespace, replicas=()) as h:
            dead = _closed_port_address()
            await h.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=router_pb2.Replica(
                replica_id="D", model="m", scheduler_address=dead, block_size=16, num_blocks=1000)))
            await _heartbeat(h, "D", router_pb2.READY)
            request = router_pb2.ReportUnreachableRequest(replica_id="D", scheduler_address=dead)
            assert (await h.stub.ReportUnreachable(request)).state == router_pb2.UNHEALTHY
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            server.add_insecure_port(dead)
            await server.start()
            try:
                assert await _heartbeat(h, "D", router_pb2.READY) == router_pb2.READY
                assert (await h.stub.ReportUnreachable(request)).state == router_pb2.READY
            finally:
                await server.stop(None)
            outcomes = h.runtime.metrics.unreachable_reports
            assert [outcomes.labels(o)._value.get() for o in ("confirmed", "refuted")] == [1, 1]
    asyncio.run(body())


def test_a_registration_with_a_negative_or_infinite_rate_is_refused_naming_the_field(redis_url: str,
                                                                                    namespace: str) -> None:
    """RegisterReplica with a negative prefill_pair_s, an infinite decode round, a negative prefill rate or a
    negative attention charge answers INVALID_ARGUMENT naming the field, and registers nothing (the replica list
    stays as it was)."""
    async def body() -> None:
        async with _router(redis_url, namespace) as h:
            before = await h.stub.ListReplicas(router_pb2.ListReplicasRequest())
            for name, value in (("prefill_pair_s", -1e-9), ("decode_round_s", float("inf")),
                                ("prefill_tokens_per_s", -5.0), ("attention_pairs_per_token", -1),
                                ("attention_free_context", -64)):
                replica = router_pb2.Replica(replica_id="bad", model="m", block_size=16, num_blocks=10,
                                             prefill_tokens_per_s=16_000.0, decode_round_s=0.01)
                setattr(replica, name, value)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.stub.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=replica))
                details = details_of(err.value)
                assert (details.code, details.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, f"replica.{name}")
            after = await h.stub.ListReplicas(router_pb2.ListReplicasRequest())
            assert [r.replica_id for r in after.replicas] == [r.replica_id for r in before.replicas]
    asyncio.run(body())
