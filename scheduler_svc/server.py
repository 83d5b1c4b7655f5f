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
  The router being down delays nothing here: the agent keeps retrying.
- Drain (SIGTERM): stop accepting Submits (UNAVAILABLE), heartbeat DRAINING, let live requests finish
  for up to `drain_timeout_s`, cancel what is left, wait for their results, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from scheduler_svc.collector import tune_collector
from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.driver import Driver
from sluice import convert, errors, glue, services
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics
from sluice.serve import grpc_server
from sluice.telemetry import extract_metadata
from sluice.types import ReplicaState
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


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Thin servicer over the Driver."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def Submit(self, request: scheduler_pb2.SubmitRequest,  # noqa: N802 (gRPC method name)
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.SubmitResponse:
        if not self.driver.accepting:
            raise errors.Unavailable(f"replica {self.driver.replica_id} is draining", reason="draining",
                                     retry_after_s=0.1)
        if not self.driver.worker_serving:
            raise errors.Unavailable(f"replica {self.driver.replica_id}: its worker is unavailable",
                                     reason="worker_unavailable", retry_after_s=self.driver.worker_retry_s)
        if not request.request_id:
            raise errors.InvalidArgument("request_id is required", field_name="request_id")
        position = self.driver.submit(request, extract_metadata(context.invocation_metadata()))
        return scheduler_pb2.SubmitResponse(queue_position=position)

    async def Cancel(self, request: scheduler_pb2.CancelRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.CancelResponse:
        status = self.driver.cancel(request.request_id)
        if status is None:
            raise errors.NotFound(f"request {request.request_id!r} is not known to replica "
                                  f"{self.driver.replica_id}", reason="unknown_request")
        return scheduler_pb2.CancelResponse(status=convert.status_to_proto(status))

    async def Stats(self, request: scheduler_pb2.StatsRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        core = self.driver.core
        return convert.stats_to_proto(core.stats(), self.driver.replica_id, core.config.max_num_batched_tokens,
                                      core.config.max_num_seqs)

    async def KvSnapshot(self, request: scheduler_pb2.KvSnapshotRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.KvSnapshotResponse:
        last_event_id, hashes = self.driver.core.kv_snapshot()
        return scheduler_pb2.KvSnapshotResponse(replica_id=self.driver.replica_id, last_event_id=last_event_id,
                                                block_hashes=hashes)


@dataclass
class ReplicaAgent:
    """Registers the replica with the router and heartbeats its state and load."""

    driver: Driver
    router: router_pb2_grpc.RouterServiceStub
    replica: router_pb2.Replica
    heartbeat_interval_s: float = 1.0
    state: ReplicaState = ReplicaState.WARMING
    """What the agent says of the replica; reported UNHEALTHY instead while the worker is down."""

    def heartbeat_request(self) -> router_pb2.HeartbeatRequest:
        """Return the next heartbeat: the reported state and the load, built by the one glue (sluice.glue)."""
        driver = self.driver
        report = glue.heartbeat_report(self.replica.replica_id, self.state, driver.worker_serving,
                                       driver.core.stats(), driver.rates)
        return convert.heartbeat_to_proto(report)

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
            if exc.code() != grpc.StatusCode.NOT_FOUND:
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
                await self.heartbeat()
            except grpc.aio.AioRpcError as exc:
                log.warning("router unreachable (%s): retrying", exc.details())
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(changed.wait())]
            if not ready.is_set():
                waiters.append(asyncio.ensure_future(ready.wait()))
            await asyncio.wait(waiters, timeout=self.heartbeat_interval_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()

    async def drain(self, drain_timeout_s: float) -> None:
        """Tell the router DRAINING, stop accepting, finish or cancel live requests (see module docstring)."""
        self.driver.accepting = False
        self.state = ReplicaState.DRAINING
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.heartbeat()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while self.driver.live_request_ids() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.driver.live_request_ids()
        if left:
            log.warning("drain timeout: cancelling %d requests", len(left))
        for request_id in left:
            self.driver.cancel(request_id)
        while self.driver.live_request_ids() and loop.time() < deadline + 10:
            await asyncio.sleep(0.05)
        await self.driver.flush()


async def start_scheduler_server(driver: Driver, health: health_aio.HealthServicer, port: int = 0,
                                 host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:
    """Start the scheduler's gRPC server with gRPC health SERVING (its worker is SERVING by then).

    Returns the server and its bound port. Raises RuntimeError if the port is taken.
    """
    server = grpc_server(SERVICE_NAME, interceptors=[errors.ErrorInterceptor()])
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(driver), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the scheduler to {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
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
        "model_id": info.model_id, "max_model_len": info.max_model_len or 4096,
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


async def start_replica(*, replica_id: str, worker_address: str, bus: Bus, router_address: str = "",
                        port: int = 0, host: str = "127.0.0.1", advertise_host: str = "127.0.0.1",
                        core_overrides: dict[str, object] | None = None, metrics: SchedulerMetrics | None = None,
                        heartbeat_interval_s: float = 1.0, prefill_tokens_per_s: float = 10_000.0,
                        decode_round_s: float = 0.01, use_stream: bool = True,
                        worker_timeout_s: float = 120.0, publish_first_max_tokens: int = 64,
                        pipeline: bool = True) -> RunningReplica:
    """Wait for the worker, build the core from its Info, serve, run the driver, register with the router.

    Raises TimeoutError (worker never SERVING), ValueError (bad core settings), RuntimeError (port taken).
    """
    worker_channel = grpc.aio.insecure_channel(worker_address)
    info = await wait_for_worker(worker_channel, worker_timeout_s)
    core = make_core(info, replica_id, **(core_overrides or {}))
    tune_collector(core.config.max_num_seqs)
    driver = Driver(core, worker_pb2_grpc.WorkerServiceStub(worker_channel), bus, replica_id=replica_id,
                    model_id=info.model_id, eos_token_id=info.eos_token_id, metrics=metrics, use_stream=use_stream,
                    worker_health=health_pb2_grpc.HealthStub(worker_channel),
                    publish_first_max_tokens=publish_first_max_tokens, pipeline=pipeline)
    health = health_aio.HealthServicer()
    server, bound = await start_scheduler_server(driver, health, port, host)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(driver.run(stop))]
    channels = [worker_channel]
    agent = None
    if router_address:
        router_channel = grpc.aio.insecure_channel(router_address)
        channels.append(router_channel)
        replica = router_pb2.Replica(
            replica_id=replica_id, model=info.model_id, scheduler_address=f"{advertise_host}:{bound}",
            state=router_pb2.WARMING, block_size=info.block_size, num_blocks=info.num_blocks,
            max_num_batched_tokens=core.config.max_num_batched_tokens, prefill_tokens_per_s=prefill_tokens_per_s,
            decode_round_s=decode_round_s)
        agent = ReplicaAgent(driver, router_pb2_grpc.RouterServiceStub(router_channel), replica,
                             heartbeat_interval_s)
        ready = asyncio.Event()
        ready.set()  # the worker is SERVING: wait_for_worker returned
        tasks.append(asyncio.create_task(agent.run(ready, stop)))
    return RunningReplica(server, bound, driver, agent, stop, tasks, channels, health)
