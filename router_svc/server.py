"""The router's gRPC service around `RouterCore`, and the loops that keep its prefix index current.

Theory of operation
- Route, RegisterReplica, Heartbeat, Drain, ListReplicas: convert, call the core with `time.time()`,
  convert back. A "routed" span continues the caller's trace.
- RegisterReplica (re)creates the replica in WARMING and fetches a KvSnapshot from its scheduler.
  A Heartbeat goes through `sluice.glue.apply_heartbeat`, the one reconciliation the simulator runs
  too: READY moves a WARMING (or UNHEALTHY) replica to READY; UNHEALTHY (its worker is down) takes
  it out of routing until it reports READY again; DRAINING drains it. A Heartbeat from a replica
  the router does not know (a restarted router), or one naming another incarnation than the registered
  one (a restarted scheduler: `router_svc.fleet`), is NOT_FOUND: the replica registers again. Route and
  ListReplicas carry the incarnation, so that admission can tell a restarted replica's lost requests
  (admission_svc/migration.py) from live ones.
- The `kv` stream is read in this router's own consumer group (`router:{router_id}`: every router
  needs every event). Events feed `apply_kv_events`; an event-id gap (False) triggers a snapshot
  fetch. While a replica's snapshot is being fetched its events are buffered and replayed on top of
  the snapshot (the core skips events at or below the snapshot's id), so nothing is lost in between.
- The `completions` stream (same group name) tells the core which routed requests are done.
- Every `expiry_interval_s`, replicas with stale heartbeats become GONE and are purged.
- ReportUnreachable (admission could not reach a replica's scheduler): the router probes that scheduler's
  gRPC health itself; a probe that fails UNAVAILABLE or DEADLINE_EXCEEDED confirms it and the replica
  turns UNHEALTHY (no traffic) until it heartbeats READY again or times out. So a dead scheduler leaves
  routing at the first failed Submit, not `heartbeat_timeout_s` later, and one caller's bad network
  cannot take a live replica out (its probe answers: refuted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace
from opentelemetry.context import Context
from redis.exceptions import ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router_svc import convert
from router_svc.core import RouterCore
from router_svc.disagg import DisaggRouter, is_disaggregated
from sluice import convert as shared_convert
from sluice import errors, glue, services, tls
from sluice.bus import Bus
from sluice.core_errors import IllegalReplicaTransition, UnknownReplica
from sluice.prom import RouterMetrics
from sluice.serve import grpc_server
from sluice.telemetry import extract_metadata, get_tracer
from sluice.tls import TlsFiles
from sluice.types import KV_HELD, KvEvent, ReplicaState
from sluice.v1 import common_pb2, events_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["RouterRuntime", "RouterServicer"]

log = logging.getLogger(__name__)
tracer = get_tracer("sluice.router")

SERVICE_NAME = services.ROUTER
KV_READ_INTERVAL_S = 0.05
"""The KV shards are read at most every 50 ms (`Bus.consume`'s min_interval_s): a replica publishes a KV entry in
most decode rounds (a block fills every 16 tokens of each request), and reading each alone cost the router a read
and an acknowledgement per round per replica. The index loses nothing by it: the router counts its own routing
decisions as cached for `prediction_ttl_s` (2 s), 40 times the wait."""
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
"""Channel option: connections not shared with other channels, so that a new channel dials afresh."""


class RouterRuntime:
    """The core plus its I/O: snapshot fetching, the KV and completion consumers, expiry."""

    def __init__(self, core: RouterCore, bus: Bus, router_id: str = "router", *,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = time.time,
                 snapshot_timeout_s: float = 5.0, tls_files: TlsFiles | None = None,
                 probe_timeout_s: float = 1.0) -> None:
        self.core = core
        self.pairs = DisaggRouter(core)
        """Prefill/decode pairs when the fleet has role replicas (router_svc.disagg)."""
        self.tls_files = tls_files
        """Credentials of the router's calls to schedulers (KvSnapshot); None: plaintext."""
        self.bus = bus
        self.router_id = router_id
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.snapshot_timeout_s = snapshot_timeout_s
        self.probe_timeout_s = probe_timeout_s
        """Timeout of the health probe that checks a ReportUnreachable."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._buffers: dict[str, list[KvEvent]] = {}  # replica id -> events held while its snapshot loads
        self._fetches: set[asyncio.Task[None]] = set()
        self.health = health_aio.HealthServicer()

    @property
    def group(self) -> str:
        """This router's consumer group on the `kv` shard streams and the `completions` stream."""
        return f"router:{self.router_id}"

    # ---- snapshots ------------------------------------------------------------------------
    def on_registered(self, replica_id: str) -> None:
        """A replica (re)registered with an empty index: drop what was buffered for it and fetch a snapshot."""
        self._buffers.pop(replica_id, None)
        self.request_snapshot(replica_id)

    def request_snapshot(self, replica_id: str) -> None:
        """Start fetching a KV snapshot of the replica unless one is already on its way."""
        if replica_id in self._buffers:
            return
        self._buffers[replica_id] = []
        task = asyncio.create_task(self._fetch_snapshot(replica_id))
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)

    async def _fetch_snapshot(self, replica_id: str, attempts: int = 3) -> None:
        buffer = self._buffers[replica_id]
        address = next((v.spec.address for v in self.core.replicas() if v.spec.replica_id == replica_id), "")
        reply = None
        for attempt in range(attempts):
            if not address:
                break
            try:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel(address))
                reply = await stub.KvSnapshot(scheduler_pb2.KvSnapshotRequest(), timeout=self.snapshot_timeout_s)
                break
            except grpc.aio.AioRpcError as exc:
                log.warning("KvSnapshot of %s at %s failed (attempt %d): %s", replica_id, address, attempt + 1,
                            exc.details())
                await asyncio.sleep(0.2 * (attempt + 1))
        if self._buffers.get(replica_id) is not buffer:
            return  # superseded: the replica re-registered or went away while we were fetching
        buffered = self._buffers.pop(replica_id)
        now = self.clock()
        if reply is None:
            self.metrics.snapshots.labels("error").inc()
            log.error("no KV snapshot of replica %s at %r: its index is rebuilt from the stream alone",
                      replica_id, address)
            # Without a snapshot the buffered events may still apply cleanly; a gap waits for the next entry.
            self.core.apply_kv_events(replica_id, buffered, now)
            return
        self.core.apply_snapshot(replica_id, reply.last_event_id, reply.block_hashes, now, reply.host_block_hashes)
        self.metrics.snapshots.labels("ok").inc()
        if buffered and not self.core.apply_kv_events(replica_id, buffered, now):
            # Not re-requested here (a stale source would make that a busy loop): the next entry of
            # this replica meets the same gap and asks for a fresh snapshot.
            self.metrics.kv_gaps.inc()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tls.aio_channel(address, self.tls_files, OWN_CONNECTION)
        return channel

    # ---- failure reports ------------------------------------------------------------------
    async def check_unreachable(self, replica_id: str, address: str, detail: str = "") -> ReplicaState:
        """Probe the scheduler a caller could not reach; take its replica out of routing when the probe fails
        too. Returns the replica's state after (GONE: not known, or known at another address)."""
        listed = next((v for v in self.core.replicas() if v.spec.replica_id == replica_id), None)
        if listed is None or listed.spec.address != address:
            self.metrics.unreachable_reports.labels("unknown").inc()
            return listed.state if listed is not None else ReplicaState.GONE
        # A fresh channel with its own connection: a cached one (or grpc's shared subchannel) may still be
        # backing off from the scheduler's restart and would fail at once although the scheduler is back.
        async with tls.aio_channel(address, self.tls_files, OWN_CONNECTION) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                timeout=self.probe_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.metrics.unreachable_reports.labels("confirmed").inc()
                    await self._drop_channel(address)
                    return self._take_out(replica_id, address, f"{detail}; probe {exc.code().name}")
        self.metrics.unreachable_reports.labels("refuted").inc()
        return self.core.state_of(replica_id) or ReplicaState.GONE

    async def _drop_channel(self, address: str) -> None:
        """Forget the cached channel to an unreachable scheduler: a restarted one is then dialled afresh."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    def _take_out(self, replica_id: str, address: str, why: str) -> ReplicaState:
        try:
            state = self.core.mark_unhealthy(replica_id, self.clock())
        except (UnknownReplica, IllegalReplicaTransition):
            return self.core.state_of(replica_id) or ReplicaState.GONE
        log.warning("replica %s: its scheduler at %s is unreachable (%s): %s, no traffic", replica_id, address,
                    why, state.value)
        self._update_gauges()
        return state

    # ---- stream handlers ------------------------------------------------------------------
    async def on_kv_entry(self, entry_id: str, payload: bytes, context: Context) -> None:
        """Apply one `kv` entry to the prefix index (buffered while a snapshot loads; a gap asks for one)."""
        batch = events_pb2.KvEventBatch.FromString(payload)
        events = shared_convert.kv_events_from_proto(batch)
        buffer = self._buffers.get(batch.replica_id)
        if buffer is not None:
            buffer.extend(events)
            return
        self.metrics.kv_events.inc(len(events))
        if not self.core.apply_kv_events(batch.replica_id, events, self.clock()):
            self.metrics.kv_gaps.inc()
            log.info("event-id gap for replica %s at entry %s: fetching a snapshot", batch.replica_id, entry_id)
            self.request_snapshot(batch.replica_id)
            self._buffers[batch.replica_id].extend(events)

    async def on_completion(self, entry_id: str, payload: bytes, context: Context) -> None:
        """Tell the core that a routed request reached its terminal state."""
        completion = events_pb2.Completion.FromString(payload)
        if self.core.on_request_done(completion.replica_id, completion.request_id, self.clock(),
                                     ran=completion.status != common_pb2.REJECTED):
            self.metrics.predictions_retracted.inc()
        if completion.detail == KV_HELD:
            return  # a prefill half whose KV goes to its decode replica: that side's claim stands
        # Any other end (the decode half's, or a request that ended on its prefill replica) forgets the request's
        # decode-side claim wherever it is.
        for replica_id in list(self.pairs.claims):
            self.pairs.on_request_done(replica_id, completion.request_id)

    # ---- loops ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, *, expiry_interval_s: float = 1.0, block_ms: int = 100) -> None:
        """Run the consumers (one per `kv` shard, one for completions) and the expiry loop until `stop` is set;
        a consumer that fails is restarted."""
        tasks = [
            *(asyncio.create_task(self._supervise(stream, self.on_kv_entry, stop, block_ms, KV_READ_INTERVAL_S))
              for stream in self.bus.kv_streams()),
            asyncio.create_task(self._supervise("completions", self.on_completion, stop, block_ms)),
            asyncio.create_task(self._expire_loop(stop, expiry_interval_s)),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in [*tasks, *self._fetches]:
                task.cancel()
            for channel in self._channels.values():
                await channel.close()

    async def _supervise(self, stream: str, handler: Callable[[str, bytes, Context], object],
                         stop: asyncio.Event, block_ms: int, min_interval_s: float = 0.0) -> None:
        while not stop.is_set():
            try:
                await self.bus.consume(stream, self.group, self.router_id, handler,  # type: ignore[arg-type]
                                       stop=stop, block_ms=block_ms, min_interval_s=min_interval_s)
            # ClusterDownError: a Redis Cluster whose slot has no primary yet (a failover in progress).
            except (RedisConnectionError, RedisTimeoutError, ClusterDownError) as exc:
                log.error("%s consumer lost Redis (%s); retrying in 1 s", stream, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    async def _expire_loop(self, stop: asyncio.Event, interval_s: float) -> None:
        while not stop.is_set():
            for replica_id in self.core.expire(self.clock()):
                log.warning("replica %s missed its heartbeats: GONE, purged", replica_id)
                self._buffers.pop(replica_id, None)
            self._update_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    def _update_gauges(self) -> None:
        counts = dict.fromkeys(ReplicaState, 0)
        for view in self.core.replicas():
            counts[view.state] += 1
        for state, count in counts.items():
            self.metrics.replicas.labels(state.value).set(count)


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Thin servicer over RouterRuntime."""

    def __init__(self, runtime: RouterRuntime) -> None:
        self.runtime = runtime
        self.core = runtime.core

    async def Route(self, request: router_pb2.RouteRequest,  # noqa: N802 (gRPC method name)
                    context: grpc.aio.ServicerContext) -> router_pb2.RouteResponse:
        query = convert.query_from_proto(request)
        with tracer.start_as_current_span("routed", context=extract_metadata(context.invocation_metadata()),
                                          kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("sluice.request_id", request.request_id)
            span.set_attribute("gen_ai.request.model", request.model)
            pair = None
            try:
                if is_disaggregated(self.core):
                    pair = self.runtime.pairs.route_pair(query, self.runtime.clock())
                    decision = pair.prefill
                else:
                    decision = self.core.route(query, self.runtime.clock())
            except Exception:
                self.runtime.metrics.route_failures.inc()
                raise
            if pair is not None:  # the pair is in the trace: where the prompt runs and where the decodes do
                span.set_attribute("sluice.prefill_replica_id", decision.replica_id)
                span.set_attribute("sluice.decode_replica_id", pair.decode_replica_id)
                span.set_attribute("sluice.kv_transfer", pair.transfers)
            span.set_attribute("sluice.replica_id", decision.replica_id)
            span.set_attribute("sluice.cached_blocks", decision.cached_blocks)
            span.set_attribute("sluice.predicted_ttft_s", decision.predicted_ttft_s)
            if request.dry_run:
                span.set_attribute("sluice.dry_run", True)
        if request.dry_run:
            self.runtime.metrics.dry_runs.inc()
        else:
            self.runtime.metrics.routes.labels(decision.replica_id).inc()
            self.runtime.metrics.cached_blocks.observe(decision.cached_blocks)
        response = convert.decision_to_proto(decision)
        chosen = self.core.fleet.find(decision.replica_id)
        response.incarnation = chosen.spec.incarnation if chosen is not None else ""
        if pair is not None and pair.transfers:
            if not request.dry_run:
                self.runtime.metrics.decode_routes.labels(pair.decode_replica_id).inc()
            decoder = self.core.fleet.find(pair.decode_replica_id)
            response.decode_replica_id = pair.decode_replica_id
            response.decode_scheduler_address = pair.decode_address
            response.decode_incarnation = decoder.spec.incarnation if decoder is not None else ""
        return response

    async def RegisterReplica(self, request: router_pb2.RegisterReplicaRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> router_pb2.RegisterReplicaResponse:
        if request.replica.role not in router_pb2.ReplicaRole.values():
            raise errors.InvalidArgument(f"unknown replica role {request.replica.role}; known: "
                                         f"{sorted(router_pb2.ReplicaRole.values())}", field_name="replica.role")
        spec = convert.spec_from_proto(request.replica)
        if not spec.replica_id or not spec.model:
            raise errors.InvalidArgument("a replica needs replica_id and model", field_name="replica")
        for name in ("prefill_tokens_per_s", "decode_round_s", "prefill_pair_s"):
            value = getattr(spec, name)
            if not math.isfinite(value) or value < 0:  # the TTFT prediction would run backwards or not at all
                raise errors.InvalidArgument(f"replica {spec.replica_id!r}: {name} must be a finite number >= 0, "
                                             f"got {value}", field_name=f"replica.{name}")
        for name in ("attention_pairs_per_token", "attention_free_context"):
            if getattr(spec, name) < 0:  # a negative charge would make deep prompts look cheaper than shallow ones
                raise errors.InvalidArgument(f"replica {spec.replica_id!r}: {name} must be >= 0, got "
                                             f"{getattr(spec, name)}", field_name=f"replica.{name}")
        previous = self.core.fleet.find(spec.replica_id)
        state = self.core.register(spec, self.runtime.clock())
        if previous is not None and previous.spec.incarnation != spec.incarnation:
            log.warning("replica %s restarted (incarnation %s -> %s): %d routed requests of the old one are lost",
                        spec.replica_id, previous.spec.incarnation or "?", spec.incarnation or "?",
                        len(previous.inflight))
        log.info("replica %s registered (%s at %s, incarnation %s)", spec.replica_id, spec.model, spec.address,
                 spec.incarnation or "?")
        self.runtime.on_registered(spec.replica_id)
        return router_pb2.RegisterReplicaResponse(state=shared_convert.replica_state_to_proto(state))

    async def Heartbeat(self, request: router_pb2.HeartbeatRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> router_pb2.HeartbeatResponse:
        report = shared_convert.heartbeat_from_proto(request)
        if not self.core.fleet.heartbeat_from(report.replica_id, request.incarnation):
            # A process that is not the one registered (a restart's old or new self): the lost requests must
            # not look served. NOT_FOUND makes a live scheduler register again, as after a router restart.
            raise errors.NotFound(f"replica {report.replica_id!r} heartbeats as incarnation "
                                  f"{request.incarnation!r}, not the registered one: register again",
                                  reason="unknown_incarnation")
        stale = self.core.stale_routes
        before, after = glue.apply_heartbeat(self.core, report, self.runtime.clock())
        if self.core.stale_routes > stale:
            self.runtime.metrics.stale_routes.inc(self.core.stale_routes - stale)
            log.info("replica %s reports itself idle: %d routed requests that never arrived are forgotten",
                     report.replica_id, self.core.stale_routes - stale)
        if before is not after and after is ReplicaState.UNHEALTHY:
            log.warning("replica %s reports its worker down: UNHEALTHY, no traffic", report.replica_id)
        elif before is ReplicaState.UNHEALTHY and after is ReplicaState.READY:
            log.info("replica %s reports its worker back: READY", report.replica_id)
        return router_pb2.HeartbeatResponse(state=shared_convert.replica_state_to_proto(after))

    async def Drain(self, request: router_pb2.DrainRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> router_pb2.DrainResponse:
        state = self.core.drain(request.replica_id, self.runtime.clock())
        return router_pb2.DrainResponse(state=shared_convert.replica_state_to_proto(state))

    async def ListReplicas(self, request: router_pb2.ListReplicasRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> router_pb2.ListReplicasResponse:
        return router_pb2.ListReplicasResponse(replicas=[convert.replica_to_proto(v) for v in self.core.replicas()])

    async def ReportUnreachable(self, request: router_pb2.ReportUnreachableRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> router_pb2.ReportUnreachableResponse:
        state = await self.runtime.check_unreachable(request.replica_id, request.scheduler_address,
                                                     request.detail[:200])
        return router_pb2.ReportUnreachableResponse(state=shared_convert.replica_state_to_proto(state))


async def start_router_server(runtime: RouterRuntime, port: int = 0, host: str = "127.0.0.1",
                              tls_files: TlsFiles | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the router's gRPC server (with gRPC health SERVING); return it and its bound port.

    `runtime.health` turns NOT_SERVING with `enter_graceful_shutdown()`. Raises RuntimeError if the port is taken.
    """
    authorize = tls.authorizer() if tls_files is not None else None
    server = grpc_server(SERVICE_NAME, interceptors=[errors.ErrorInterceptor(authorize=authorize)])
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(runtime), server)
    health_pb2_grpc.add_HealthServicer_to_server(runtime.health, server)
    bound = tls.listen(server, f"{host}:{port}", tls_files)
    if bound == 0:
        raise RuntimeError(f"cannot bind the router to {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await runtime.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
