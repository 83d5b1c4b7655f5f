"""The scheduler's gRPC service (Submit, Cancel, Stats, KvSnapshot) and its presence at the router.

Theory of operation
- The servicer is thin: convert, call the `Driver` (which owns the core), convert back. Core refusals
  become statuses through the one `ErrorInterceptor` (sluice.errors.from_core_error).
- `ReplicaAgent` makes the replica known: RegisterReplica (WARMING, with the worker's block size and
  capacity), a Heartbeat with READY and the load once the worker's health is SERVING, then a heartbeat
  every `heartbeat_interval_s`. A heartbeat answered NOT_FOUND (a restarted router) registers again.
  The heartbeat is built by `sluice.glue.heartbeat_report` (the glue the simulator runs too): the
  load carries the rates the driver measured (decode round, prefill tokens/s) once it has them.
  Before each heartbeat the agent probes the worker; while it is down the heartbeat says UNHEALTHY
  (the router routes nothing here) and Submit answers UNAVAILABLE reason `worker_unavailable`; the
  driver's `worker_changed` makes the agent heartbeat at once on either change.
  The router being down delays nothing here: the agent keeps retrying. Registration and heartbeats carry
  the process's incarnation (`Replica.incarnation`, set by the agent, new on every start): a scheduler
  restarted on the same address is a new incarnation, so the router and admission know the old one's
  requests are lost.
- Drain (SIGTERM, or the router answering a heartbeat with DRAINING after its Drain RPC): stop accepting
  Submits (UNAVAILABLE, reason `draining`), heartbeat DRAINING, let live requests finish for up to
  `drain_timeout_s`, then cancel what is left with detail `DRAIN_HANDOFF`: admission takes that
  cancel as the hand-off to migration (admission_svc/migration.py) and moves those requests to other replicas. Once
  their results are published the agent heartbeats GONE (the router removes the replica), stops
  heartbeating and sets `retired`: health turns NOT_SERVING and the process may be stopped (SIGTERM
  then exits 0 at once). It does not exit by itself, so that whoever asked for the drain (the planner's
  launcher, a supervisor) decides, and no restart policy mistakes it for a crash. A drain runs once.
- Lookup (admission's watchdog, for requests that went quiet): which of the ids are live here, and the
  completions of those that ended recently (`Publisher.recent`), so that one lost on the bus is fetched again.
- Owner leases (scheduler_svc/leases.py): a Submit naming its owner's incarnation ties the request to that
  admission process's lease, which RenewLease extends; every LEASE_SWEEP_S the requests of owners whose lease
  lapsed (the admission process died or lost this replica) are cancelled with detail `owner_gone`.
- Redis not answering (`bus_alive` False, from sluice.serve.BusWatch): Submit answers UNAVAILABLE
  reason `bus_unavailable` (its tokens could not reach the client); gRPC health is NOT_SERVING.
  What was already running keeps running: the publisher holds its tokens until Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from scheduler_svc.collector import tune_collector
from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.driver import Driver
from scheduler_svc.handoff import KvReceiver
from scheduler_svc.leases import OwnerLeases
from scheduler_svc.worker_link import RoundLinkTarget
from sluice import convert, errors, glue, services, telemetry, tls
from sluice import round_link as sluice_round_link
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics
from sluice.serve import grpc_server
from sluice.telemetry import extract_metadata
from sluice.tls import TlsFiles
from sluice.types import DRAIN_HANDOFF, ReplicaRole, ReplicaState, RequestStatus
from sluice.v1 import (
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = [
    "ReplicaAgent", "RunningReplica", "SchedulerServicer", "make_core", "start_replica", "start_scheduler_server",
    "wait_for_worker",
]

log = logging.getLogger(__name__)

SERVICE_NAME = services.SCHEDULER
OWNER_GONE = "owner_gone"
"""Detail prefix of a request cancelled because its owner (an admission process) stopped renewing its lease."""
MAX_LOOKUP_IDS = 4096
"""Request ids one Lookup may ask about (a bound on the work one call costs)."""
MAX_LEASE_S = 300.0
"""Longest owner lease one RenewLease may ask for."""
LEASE_SWEEP_S = 0.5
"""How often requests of owners whose lease lapsed are looked for (and cancelled)."""
DEFAULT_MAX_MODEL_LEN = 4096
"""Context length assumed for a worker whose Info reports none."""

CoreOverrides = Mapping[str, object] | Callable[[worker_pb2.WorkerInfo], Mapping[str, object]]
"""SchedulerConfig fields a replica starts with, or a function of its worker's Info returning them."""


def _check_submission(request: scheduler_pb2.SubmitRequest, vocab_size: int, structured_output: bool = True,
                      structured_resume: bool = True) -> None:
    """Raise InvalidArgument for what the worker would refuse in a plan (worker_svc/validation.py): a refused
    plan looks like a lost worker to the driver, so one such request would take the replica out of rotation;
    and for structured output on an engine that declares it cannot honour it (the cost model)."""
    if request.sampling.json_schema and not structured_output:
        raise errors.InvalidArgument("structured output (response_format json_object / json_schema, or a forced "
                                     "tool call) is not supported by this replica's engine (the cost model "
                                     "makes no text a grammar could constrain)", field_name="response_format")
    if request.sampling.json_prefix_ids and not structured_resume:
        raise errors.InvalidArgument("a structured request cannot resume mid-document on this engine (its grammar "
                                     "starts at the document's start)", field_name="sampling.json_prefix_ids")
    if request.stream_interval < 0:
        raise errors.InvalidArgument(f"stream_interval {request.stream_interval}: tokens a chunk carries, at least 0 "
                                     "(0 and 1: every token)", field_name="stream_interval")
    ids = request.prompt_token_ids
    if vocab_size and ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise errors.InvalidArgument(f"prompt token id {bad} is outside 0..{vocab_size - 1}",
                                     field_name="prompt_token_ids")
    sampling = request.sampling
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0) or sampling.top_k < 0 \
            or math.isinf(sampling.top_p):
        raise errors.InvalidArgument(f"sampling: temperature {sampling.temperature} (finite, >= 0), top_k "
                                     f"{sampling.top_k} (>= 0), top_p {sampling.top_p} (finite)", field_name="sampling")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Thin servicer over the Driver."""

    def __init__(self, driver: Driver, bus_alive: Callable[[], bool] = lambda: True,
                 receiver: KvReceiver | None = None) -> None:
        self.driver = driver
        self.receiver = receiver
        """Both sides of prefill/decode hand-offs (scheduler_svc/handoff.py); None: Submit refuses kv_source."""
        self.bus_alive = bus_alive
        """False while Redis does not answer (sluice.serve.BusWatch): tokens could not be delivered."""
        self.leases = OwnerLeases()
        """The leases of the admission processes that own the requests here (scheduler_svc/leases.py)."""

    def cancel_orphans(self) -> int:
        """Cancel the requests whose owner's lease lapsed (detail `owner_gone`); return how many."""
        driver = self.driver
        cancelled = 0
        for owner, request_ids in self.leases.lapsed(driver.clock(), set(driver.live_request_ids())):
            log.warning("owner %s (incarnation %s) stopped renewing its lease: cancelling its %d requests",
                        owner.owner, owner.incarnation, len(request_ids))
            for request_id in request_ids:
                detail = f"{OWNER_GONE}: admission {owner.owner} stopped renewing its lease"
                cancelled += driver.cancel(request_id, detail) is not None
        return cancelled

    async def Submit(self, request: scheduler_pb2.SubmitRequest,  # noqa: N802 (gRPC method name)
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.SubmitResponse:
        if not self.driver.accepting:
            raise errors.Unavailable(f"replica {self.driver.replica_id} is draining", reason="draining",
                                     retry_after_s=0.1)
        if not self.driver.worker_serving:
            raise errors.Unavailable(f"replica {self.driver.replica_id}: its worker is unavailable",
                                     reason="worker_unavailable", retry_after_s=self.driver.worker_retry_s)
        if not self.bus_alive():
            raise errors.Unavailable(f"replica {self.driver.replica_id}: Redis does not answer, so its tokens "
                                     "could not reach the client", reason="bus_unavailable", retry_after_s=1.0)
        if not request.request_id:
            raise errors.InvalidArgument("request_id is required", field_name="request_id")
        _check_submission(request, self.driver.vocab_size, self.driver.structured_output,
                          self.driver.structured_resume)
        parent = extract_metadata(context.invocation_metadata())
        if request.HasField("kv_source"):
            if self.receiver is None:
                raise errors.InvalidArgument("this replica takes no KV hand-off", field_name="kv_source")
            if not request.kv_source.scheduler_address or not request.kv_source.request_id:
                raise errors.InvalidArgument("kv_source needs scheduler_address and request_id",
                                             field_name="kv_source")
            position = await self.receiver.receive(request, parent, context.time_remaining())
        else:
            position = self.driver.submit(request, parent)
        self.leases.track(request.request_id, request.owner, request.owner_incarnation, self.driver.clock())
        return scheduler_pb2.SubmitResponse(queue_position=position)

    async def Cancel(self, request: scheduler_pb2.CancelRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.CancelResponse:
        released = 0
        if self.receiver is not None:
            await self.receiver.cancel(request.request_id)  # a decode half whose blocks are on their way
            released = self.receiver.release(request.request_id, "cancelled")  # a held prefill half
        status = self.driver.cancel(request.request_id)
        if status is None and released:
            status = RequestStatus.FINISHED_LENGTH  # a held prefill half: it ended, its hold did now
        if status is None:
            raise errors.NotFound(f"request {request.request_id!r} is not known to replica "
                                  f"{self.driver.replica_id}", reason="unknown_request")
        return scheduler_pb2.CancelResponse(status=convert.status_to_proto(status))

    async def Stats(self, request: scheduler_pb2.StatsRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        core = self.driver.core
        stats = convert.stats_to_proto(core.stats(), self.driver.replica_id, core.config.max_num_batched_tokens,
                                       core.config.max_num_seqs)
        handoffs = getattr(core, "handoffs", None)  # a vLLM engine's gateway core takes part in no hand-off
        stats.kv_blocks_held = handoffs.held_blocks if handoffs is not None else 0
        convert.totals_to_proto(self.driver.reporter.totals, stats)
        return stats

    async def HeldKv(self, request: scheduler_pb2.HeldKvRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.HeldKvResponse:
        held = None if self.receiver is None else self.receiver.held(request.request_id)
        if held is None:
            raise errors.NotFound(f"replica {self.driver.replica_id} holds no KV blocks for request "
                                  f"{request.request_id!r}", reason="no_held_kv")
        return held

    async def ReleaseKv(self, request: scheduler_pb2.ReleaseKvRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.ReleaseKvResponse:
        blocks = 0 if self.receiver is None else self.receiver.release(request.request_id, request.reason)
        return scheduler_pb2.ReleaseKvResponse(blocks=blocks)

    async def Lookup(self, request: scheduler_pb2.LookupRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.LookupResponse:
        if len(request.request_ids) > MAX_LOOKUP_IDS:
            raise errors.InvalidArgument(f"at most {MAX_LOOKUP_IDS} request_ids per Lookup, got "
                                         f"{len(request.request_ids)}", field_name="request_ids")
        live_ids, remembered = set(self.driver.live_request_ids()), self.driver.publisher.recent
        reply = scheduler_pb2.LookupResponse()
        for request_id in request.request_ids:
            if request_id in live_ids:
                reply.live.append(request_id)
            elif (completion := remembered.get(request_id)) is not None:
                reply.recent.append(completion)
        return reply

    async def RenewLease(self, request: scheduler_pb2.RenewLeaseRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.RenewLeaseResponse:
        if not request.owner or not request.owner_incarnation:
            raise errors.InvalidArgument("a lease needs owner and owner_incarnation", field_name="owner")
        if not (math.isfinite(request.ttl_s) and 0 < request.ttl_s <= MAX_LEASE_S):
            raise errors.InvalidArgument(f"ttl_s must be in (0, {MAX_LEASE_S}], got {request.ttl_s}",
                                         field_name="ttl_s")
        held = self.leases.renew(request.owner, request.owner_incarnation, request.ttl_s, self.driver.clock())
        return scheduler_pb2.RenewLeaseResponse(requests=held)

    async def KvSnapshot(self, request: scheduler_pb2.KvSnapshotRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.KvSnapshotResponse:
        core = self.driver.core
        last_event_id, hashes = core.kv_snapshot()
        return scheduler_pb2.KvSnapshotResponse(replica_id=self.driver.replica_id, last_event_id=last_event_id,
                                                block_hashes=hashes, host_block_hashes=core.host_hashes())


@dataclass
class ReplicaAgent:
    """Registers the replica with the router and heartbeats its state and load."""

    driver: Driver
    router: router_pb2_grpc.RouterServiceStub
    replica: router_pb2.Replica
    heartbeat_interval_s: float = 1.0
    state: ReplicaState = ReplicaState.WARMING
    """What the agent says of the replica; reported UNHEALTHY instead while the worker is down."""
    drain_timeout_s: float = 30.0
    """How long a drain the router asked for lets live requests finish before handing the rest over."""
    retired: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once drained and removed from the router: nothing runs here any more."""
    _drain_task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        if not self.replica.incarnation:  # new on every start of the process (router_pb2.Replica.incarnation)
            self.replica.incarnation = uuid.uuid4().hex[:16]

    def heartbeat_request(self) -> router_pb2.HeartbeatRequest:
        """Return the next heartbeat: the reported state and the load, built by the one glue (sluice.glue)."""
        driver = self.driver
        report = glue.heartbeat_report(self.replica.replica_id, self.state, driver.worker_serving,
                                       driver.core.stats(), driver.rates)
        request = convert.heartbeat_to_proto(report)
        request.incarnation = self.replica.incarnation
        return request

    async def register(self) -> None:
        """Register (WARMING). Raises grpc.aio.AioRpcError when the router cannot be reached."""
        await self.router.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=self.replica), timeout=5)
        log.info("registered %s with the router", self.replica.replica_id)

    async def heartbeat(self) -> int:
        """Send one heartbeat (re-registering if the router forgot us); return the router's state for us."""
        request = self.heartbeat_request()
        try:
            reply = await self.router.Heartbeat(request, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or self.state is ReplicaState.GONE:
                raise
            await self.register()
            reply = await self.router.Heartbeat(request, timeout=5)
        return int(reply.state)

    async def run(self, ready: asyncio.Event, stop: asyncio.Event) -> None:
        """Register, then heartbeat (READY once `ready` is set) until `stop`; router errors are retried."""
        registered = False
        while not stop.is_set():
            changed = self.driver.worker_changed
            changed.clear()
            try:
                if not registered:
                    await self.register()
                    registered = True
                if ready.is_set() and self.state is ReplicaState.WARMING:
                    self.state = ReplicaState.READY
                if self.driver.worker_serving:
                    await self.driver.probe_worker()  # an idle replica notices a dead worker too
                if await self.heartbeat() == router_pb2.DRAINING and self._drain_task is None:
                    log.info("the router drains %s", self.replica.replica_id)
                    self.start_drain(self.drain_timeout_s)  # heartbeats go on (DRAINING) while it drains
            except grpc.aio.AioRpcError as exc:
                log.warning("router unreachable (%s): retrying", exc.details())
            if self.state is ReplicaState.GONE:
                log.info("%s retired: no more heartbeats; it may be stopped", self.replica.replica_id)
                await stop.wait()
                return
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(changed.wait())]
            if not ready.is_set():
                waiters.append(asyncio.ensure_future(ready.wait()))
            await asyncio.wait(waiters, timeout=self.heartbeat_interval_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()

    def start_drain(self, drain_timeout_s: float) -> asyncio.Task[None]:
        """Start the drain once (see the module docstring): no Submit is accepted from now on; returns its task."""
        if self._drain_task is None:
            self.driver.accepting = False
            self.state = ReplicaState.DRAINING
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(drain_timeout_s))
        return self._drain_task

    async def drain(self, drain_timeout_s: float) -> None:
        """Drain once and wait for it; a second call waits for the first."""
        await asyncio.shield(self.start_drain(drain_timeout_s))

    async def _drain(self, drain_timeout_s: float) -> None:
        """Tell the router DRAINING, stop accepting, finish or hand off live requests, retire."""
        started = asyncio.get_running_loop().time()
        span = telemetry.get_tracer("sluice.scheduler").start_span("replica.drain", attributes={
            "sluice.replica_id": self.replica.replica_id, "sluice.drain_timeout_s": drain_timeout_s})
        self.driver.accepting = False
        self.state = ReplicaState.DRAINING
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.heartbeat()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while self.driver.live_request_ids() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.driver.live_request_ids()
        metrics = self.driver.metrics
        if left:
            log.warning("drain timeout: handing %d requests to migration", len(left))
            metrics.handed_off.inc(len(left))
        for request_id in left:
            self.driver.cancel(request_id, DRAIN_HANDOFF)
        while self.driver.live_request_ids() and loop.time() < deadline + 10:
            await asyncio.sleep(0.05)
        await self.driver.flush()
        metrics.drains.labels("handed_off" if left else "finished").inc()
        metrics.drain_duration.observe(loop.time() - started)
        span.add_event("drained", attributes={"sluice.handed_off": len(left), "sluice.drain_s": loop.time() - started})
        span.end()
        self.state = ReplicaState.GONE
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.heartbeat()  # the router removes the replica now, not at its heartbeat timeout
        self.retired.set()


async def start_scheduler_server(driver: Driver, health: health_aio.HealthServicer, port: int = 0,
                                 host: str = "127.0.0.1",
                                 tls_files: TlsFiles | None = None,
                                 bus_alive: Callable[[], bool] = lambda: True,
                                 receiver: KvReceiver | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the scheduler's gRPC server with gRPC health SERVING (its worker is SERVING by then).

    Returns the server and its bound port. Raises RuntimeError if the port is taken.
    """
    authorize = tls.authorizer() if tls_files is not None else None
    server = grpc_server(SERVICE_NAME, interceptors=[errors.ErrorInterceptor(authorize=authorize)])
    servicer = SchedulerServicer(driver, bus_alive, receiver)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = tls.listen(server, f"{host}:{port}", tls_files)
    if bound == 0:
        raise RuntimeError(f"cannot bind the scheduler to {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    sweeper = asyncio.create_task(_sweep_leases(servicer))
    _SWEEPERS.add(sweeper)
    sweeper.add_done_callback(_SWEEPERS.discard)
    return server, bound


async def wait_for_worker(channel: grpc.aio.Channel, timeout_s: float = 120.0) -> worker_pb2.WorkerInfo:
    """Wait until the worker's health is SERVING, then return its Info.

    Raises TimeoutError when it is not SERVING within timeout_s.
    """
    health = health_pb2_grpc.HealthStub(channel)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=services.WORKER), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return await worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.info("waiting for the worker: %s", exc.code().name)
        if loop.time() > deadline:
            raise TimeoutError(f"the worker was not SERVING within {timeout_s} s")
        await asyncio.sleep(0.1)


def make_core(info: worker_pb2.WorkerInfo, replica_id: str, **overrides: object) -> SchedulerCore:
    """Return a SchedulerCore sized from the worker's Info (blocks, block size, model length), with overrides.

    Raises ValueError (from the core) on an inconsistent configuration.
    """
    settings: dict[str, object] = {
        "num_blocks": info.num_blocks, "block_size": info.block_size, "num_host_blocks": info.num_host_blocks,
        "model_id": info.model_id, "max_model_len": info.max_model_len or DEFAULT_MAX_MODEL_LEN,
    }
    settings.update(overrides)
    return SchedulerCore(SchedulerConfig(**settings), replica_id=replica_id)  # type: ignore[arg-type]


@dataclass
class RunningReplica:
    """A started scheduler: server, driver, router agent (if any) and their tasks."""

    server: grpc.aio.Server
    port: int
    driver: Driver
    agent: ReplicaAgent | None
    stop_event: asyncio.Event
    tasks: list[asyncio.Task[None]]
    channels: list[grpc.aio.Channel]
    health: health_aio.HealthServicer

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Drain (health NOT_SERVING, router told DRAINING, live requests finished or cancelled), then stop."""
        await self.health.enter_graceful_shutdown()
        if self.agent is not None:
            await self.agent.drain(drain_timeout_s)
        else:
            self.driver.accepting = False
        self.stop_event.set()
        await asyncio.gather(*self.tasks)
        await self.server.stop(1.0)
        for channel in self.channels:
            await channel.close()


_SWEEPERS: set[asyncio.Task[None]] = set()
"""The lease sweepers of the servers started in this process (held so that they are not collected)."""


async def _sweep_leases(servicer: SchedulerServicer) -> None:
    """Cancel the requests of owners whose lease lapsed, every LEASE_SWEEP_S, while the event loop runs.

    A sweep that wakes more than LEASE_SWEEP_S late finds a loop that did not run (the process was stopped or
    starved): the renewals sent meanwhile wait unread in its sockets, so the leases are moved later by that
    lateness (`OwnerLeases.pause`) and this sweep is skipped, letting them be read before the next one judges."""
    loop = asyncio.get_running_loop()
    due = loop.time() + LEASE_SWEEP_S
    while True:
        await asyncio.sleep(max(0.0, due - loop.time()))
        late = loop.time() - due
        due = loop.time() + LEASE_SWEEP_S
        if late > LEASE_SWEEP_S:
            log.warning("the owner-lease sweep woke %.1f s late (this process was stopped, starved or its loop "
                        "busy): every lease extended by as much", late)
            servicer.leases.pause(late)
            servicer.driver.metrics.lease_sweep_late.inc(late)
            continue
        try:
            servicer.cancel_orphans()
        except Exception:  # the sweep must outlive one bad pass
            log.exception("owner lease sweep failed")


async def _not_serving_when_retired(agent: ReplicaAgent, health: health_aio.HealthServicer,
                                    stop: asyncio.Event) -> None:
    """Turn health NOT_SERVING once the agent has retired the replica (or return at `stop`)."""
    waiters = [asyncio.ensure_future(agent.retired.wait()), asyncio.ensure_future(stop.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    if agent.retired.is_set():
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await stop.wait()  # a watched task: ending now would stop the process


async def start_replica(*, replica_id: str, worker_address: str, bus: Bus, router_address: str = "",
                        kv_worker_address: str = "", kv_room_wait_s: float = 5.0,
                        port: int = 0, host: str = "127.0.0.1", advertise_host: str = "127.0.0.1",
                        core_overrides: CoreOverrides | None = None, metrics: SchedulerMetrics | None = None,
                        heartbeat_interval_s: float = 1.0, prefill_tokens_per_s: float = 10_000.0,
                        decode_round_s: float = 0.01, prefill_pair_s: float = 0.0, use_stream: bool = True,
                        worker_timeout_s: float = 120.0, publish_first_max_tokens: int = 64,
                        tls_files: TlsFiles | None = None,
                        bus_alive: Callable[[], bool] = lambda: True,
                        drain_timeout_s: float = 30.0, pipeline: bool = True,
                        role: ReplicaRole = ReplicaRole.BOTH, round_link: bool = True,
                        kv_linger_s: float = 0.0, publish_interval_s: float = 0.0) -> RunningReplica:
    """Wait for the worker, build the core from its Info, serve, run the driver, register with the router.

    `core_overrides`: SchedulerConfig fields, or a function of the worker's Info returning them (settings sized
    from the model, such as the attention charge). `round_link`: send rounds over the worker's round link when its
    Info offers one (else ExecuteStream). `kv_linger_s`: how long KV events may wait to be merged, `publish_interval_s`:
    how long a round's tokens queued soon after the last publication wait for later rounds' (Publisher).
    Raises TimeoutError (worker never SERVING), ValueError (bad
    core settings), RuntimeError (port taken).
    """
    worker_channel = tls.aio_channel(worker_address, tls_files)
    info = await wait_for_worker(worker_channel, worker_timeout_s)
    overrides = core_overrides(info) if callable(core_overrides) else core_overrides
    try:
        core = make_core(info, replica_id, **(overrides or {}))
    except ValueError as exc:
        if (overrides or {}).get("host_prefix_cache") and info.num_host_blocks < 1:
            raise ValueError(f"--host-prefix-cache needs host blocks, and the worker at {worker_address} offers none "
                             f"(start it with --host-blocks N)") from exc
        raise
    config = core.config
    # The budgets as run (a --tpot-slo-ms start derives some of them): what an operator checks first.
    log.info("replica %s round budgets: %d tokens, %d seats, KV read %s, attention charge %s, prefill chunk %d",
             replica_id, config.max_num_batched_tokens, config.max_num_seqs,
             config.max_kv_read_tokens if config.max_kv_read_tokens is not None else "unbounded",
             f"1 token per {config.attention_pairs_per_token} pairs past {config.attention_free_context}"
             if config.attention_pairs_per_token is not None else "none", config.max_prefill_chunk)
    if config.host_prefix_cache:
        log.info("replica %s host prefix tier: %d host blocks of %d tokens", replica_id, config.num_host_blocks,
                 config.block_size)
    tune_collector(config.max_num_seqs)
    driver = Driver(core, worker_pb2_grpc.WorkerServiceStub(worker_channel), bus, replica_id=replica_id,
                    model_id=info.model_id, eos_token_id=info.eos_token_id, metrics=metrics, use_stream=use_stream,
                    worker_health=health_pb2_grpc.HealthStub(worker_channel),
                    publish_first_max_tokens=publish_first_max_tokens, vocab_size=info.vocab_size,
                    structured_output=info.structured_output, worker_incarnation=info.incarnation,
                    pipeline=pipeline, kv_linger_s=kv_linger_s, publish_interval_s=publish_interval_s, round_link=RoundLinkTarget.of(
                        worker_address, info.round_link_port,
                        sluice_round_link.client_ssl(tls_files) if tls_files is not None else None)
                    if round_link else None)
    # Both sides of KV hand-offs (a BOTH replica may be either end of a pair whose other end differs).
    # The worker as other replicas' workers reach it for KV pulls (its pod address in Kubernetes).
    receiver = KvReceiver(driver, worker_pb2_grpc.WorkerServiceStub(worker_channel),
                          kv_worker_address or worker_address, tls_files, room_wait_s=kv_room_wait_s)
    driver.on_scheduled = receiver.on_scheduled
    health = health_aio.HealthServicer()
    server, bound = await start_scheduler_server(driver, health, port, host, tls_files, bus_alive, receiver)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(driver.run(stop))]
    channels = [worker_channel]
    agent = None
    if router_address:
        router_channel = tls.aio_channel(router_address, tls_files)
        channels.append(router_channel)
        replica = router_pb2.Replica(
            replica_id=replica_id, model=info.model_id, scheduler_address=f"{advertise_host}:{bound}",
            state=router_pb2.WARMING, block_size=info.block_size, num_blocks=info.num_blocks,
            max_num_batched_tokens=core.config.max_num_batched_tokens, prefill_tokens_per_s=prefill_tokens_per_s,
            decode_round_s=decode_round_s, prefill_pair_s=prefill_pair_s, role=convert.role_to_proto(role),
            attention_pairs_per_token=core.config.attention_pairs_per_token or 0,
            attention_free_context=core.config.attention_free_context)
        agent = ReplicaAgent(driver, router_pb2_grpc.RouterServiceStub(router_channel), replica,
                             heartbeat_interval_s, drain_timeout_s=drain_timeout_s)
        ready = asyncio.Event()
        ready.set()  # the worker is SERVING: wait_for_worker returned
        tasks.append(asyncio.create_task(agent.run(ready, stop)))
        tasks.append(asyncio.create_task(_not_serving_when_retired(agent, health, stop)))
    return RunningReplica(server, bound, driver, agent, stop, tasks, channels, health)
