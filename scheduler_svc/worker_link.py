"""The replica's link to its worker: rounds over one ExecuteStream, health, and what rounds take.

- `execute` sends a plan and returns the worker's result, or None when the call broke (stream
  closed, UNAVAILABLE): the round is then lost with the worker, and the stream is dropped.
- A plan the worker refuses (INVALID_ARGUMENT: it does not fit the worker) is not a lost worker: on the
  stream the worker answers it with a failed round (`error`), and a unary refusal is turned into one here,
  so the core fails that round's requests and the replica keeps serving.
- Pipelined rounds: `send` writes a plan on the stream without waiting and `receive` reads the oldest
  answer; the stream keeps them in order, so the worker finds round N+1 queued when N ends.
- `serving` is False while the worker is unreachable; every change sets `changed` (the agent
  heartbeats at once) and calls `on_change` (the loop wakes up). `probe` asks the worker's gRPC
  health (else Info) and marks it down when it does not answer; the loop marks it up again.
- What rounds take is measured by the driver with `sluice.glue.RoundRates` (the one glue the simulator
  shares); heartbeats carry it to the router's TTFT prediction.
- The round link: when the worker's Info offers one (`round_link_port`) and `round_link` is on, the stream of
  rounds is a plain stream of protobuf frames (sluice/round_link.py) to that port on the worker's host, with the
  same semantics (in order, pipelined, a broken link loses the round in flight and is reopened); health and Info
  stay on gRPC. It costs the scheduler less CPU per round than grpc.aio's stream (docs/benchmarks.md). The port is
  read again from each Info (a restarted worker may offer another); a link that cannot be opened while the worker
  answers (a firewall, an old worker) is logged and the rounds go over ExecuteStream until the next Info.
  `sluice_scheduler_worker_link{kind}` says which is in use.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice import convert, round_link, services
from sluice.plan_encoder import PlanEncoder
from sluice.prom import WORKER_LINKS, SchedulerMetrics
from sluice.round_link import FrameError, FrameStream
from sluice.types import RoundPlan, RoundResult
from sluice.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["RoundLinkTarget", "WorkerLink"]

log = logging.getLogger(__name__)

BROKEN = (grpc.aio.AioRpcError, grpc.aio.UsageError, OSError, asyncio.InvalidStateError)
"""What a broken round stream raises (OSError: ConnectionError, FrameError and TimeoutError among them;
InvalidStateError: a gRPC call that ended after its last answer was read)."""
OPEN_TIMEOUT_S = 2.0
"""A round link that does not answer its preface by then is not used (the rounds go over ExecuteStream)."""


@dataclass(frozen=True)
class RoundLinkTarget:
    """Where a worker's round link is: the host of the worker's address, the port its Info offered, and TLS."""

    host: str
    port: int
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def of(cls, worker_address: str, port: int, ssl_context: ssl.SSLContext | None = None) -> RoundLinkTarget:
        """Return the target on the host of `worker_address` (HOST:PORT, [IPv6]:PORT)."""
        host = worker_address.rsplit(":", 1)[0] if ":" in worker_address else worker_address
        return cls(host.strip("[]"), port, ssl_context)


class _GrpcRounds:
    """The round stream as one ExecuteStream call."""

    kind = "grpc_stream"

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call

    async def write(self, wire: worker_pb2.RoundPlan) -> None:
        await self.call.write(wire)

    async def read(self) -> worker_pb2.RoundResult:
        reply = await self.call.read()
        if reply is grpc.aio.EOF:
            raise ConnectionError("the worker closed the round stream")
        return reply  # type: ignore[no-any-return]

    def close(self) -> None:
        self.call.cancel()


class _LinkRounds:
    """The round stream as a round link (sluice/round_link.py)."""

    kind = "round_link"

    def __init__(self, stream: FrameStream) -> None:
        self.stream = stream

    async def write(self, wire: worker_pb2.RoundPlan) -> None:
        self.stream.write(wire.SerializeToString())
        await self.stream.drain()

    async def read(self) -> worker_pb2.RoundResult:
        payload = await self.stream.read()
        try:
            return worker_pb2.RoundResult.FromString(payload)
        except DecodeError as exc:
            error = FrameError(f"a {len(payload)}-byte frame is not a RoundResult: {exc}", reason="not_a_result")
            self.stream.close(error)
            raise error from None

    def close(self) -> None:
        self.stream.close()


class WorkerLink:
    """One worker, as the round loop sees it. See the module docstring."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, *, metrics: SchedulerMetrics,
                 health: health_pb2_grpc.HealthStub | None = None, use_stream: bool = True,
                 on_change: Callable[[], None] = lambda: None, round_link: RoundLinkTarget | None = None) -> None:
        self.stub = stub
        self.health = health
        self.metrics = metrics
        self.use_stream = use_stream
        self.on_change = on_change
        self.serving = True
        """False while the worker is unreachable (no rounds run; Submit refuses; the router is told)."""
        self.changed = asyncio.Event()
        """Set whenever `serving` changes."""
        self.round_link = round_link if use_stream else None
        """Where the worker's round link is; None: not used (refused by configuration, or the unary link)."""
        self.round_link_port = self.round_link.port if self.round_link is not None else 0
        """The round link's port, from the worker's latest Info; 0: none (rounds over ExecuteStream)."""
        self._stream: _GrpcRounds | _LinkRounds | None = None
        self._kind = ""
        self._set_kind("grpc_stream" if use_stream else "grpc_unary", say=not use_stream)
        self._encoder = PlanEncoder()
        """Builds each plan's wire form from the round before's (sluice/plan_encoder.py)."""

    def set_serving(self, serving: bool, waiting: int = 0) -> None:
        """Record whether the worker serves; a change sets `changed` and calls `on_change`."""
        if serving == self.serving:
            return
        self.serving = serving
        self.changed.set()
        self.on_change()
        if serving:
            log.info("the worker answers again: running rounds")
        else:
            log.error("the worker is unavailable: no rounds until it answers; %d requests wait", waiting)

    def drop_stream(self) -> None:
        """Cancel the round stream, if any (the next round opens a new one)."""
        stream = self._stream
        if stream is not None:
            stream.close()
            self._stream = None
            if isinstance(stream, _LinkRounds):
                self.metrics.round_link_frames.untrack(stream.stream)

    async def _open(self) -> _GrpcRounds | _LinkRounds:
        """Open the round stream: the round link when the worker offers one, else an ExecuteStream call."""
        target = self.round_link
        if target is not None and self.round_link_port:
            try:
                stream = await round_link.open_stream(target.host, self.round_link_port, target.ssl_context,
                                                      timeout_s=OPEN_TIMEOUT_S)
            except OSError as exc:  # refused, unreachable, not a round link, TLS refused, no answer in time
                log.warning("the worker's round link at %s:%d cannot be opened (%s): rounds go over ExecuteStream "
                            "until its next Info", target.host, self.round_link_port, exc)
                self.round_link_port = 0
            else:
                self.metrics.round_link_frames.track(stream)
                self._set_kind("round_link")
                return _LinkRounds(stream)
        self._set_kind("grpc_stream")
        return _GrpcRounds(self.stub.ExecuteStream())

    def _set_kind(self, kind: str, say: bool = True) -> None:
        if kind != self._kind:
            self._kind = kind
            for name in WORKER_LINKS:
                self.metrics.worker_link.labels(name).set(1 if name == kind else 0)
            if say:
                log.info("rounds go to the worker over %s", kind)

    async def probe(self) -> bool:
        """Ask the worker whether it serves (gRPC health, else Info); mark it down when it does not; return
        the answer. Marking it up again is the loop's (it resets the cache first)."""
        try:
            if self.health is not None:
                reply = await self.health.Check(health_pb2.HealthCheckRequest(service=services.WORKER), timeout=2.0)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            else:
                await self.stub.Info(worker_pb2.InfoRequest(), timeout=2.0)
                serving = True
        except grpc.aio.AioRpcError:
            serving = False
        if not serving:
            self.set_serving(False)
        return serving

    async def incarnation(self) -> str | None:
        """Return the worker's incarnation (WorkerInfo.incarnation), or None when its Info does not answer."""
        try:
            reply = await self.stub.Info(worker_pb2.InfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return None
        if self.round_link is not None:
            self.round_link_port = reply.round_link_port  # a restarted worker may offer another port, or none
        return reply.incarnation

    async def send(self, plan: RoundPlan, sent: Callable[[], None],
                   traces: Sequence[worker_pb2.RequestTrace] = ()) -> bool:
        """Write `plan` on the round stream (opened if needed) without waiting for its answer; call `sent()`
        exactly once; return False when the stream broke (the stream is dropped)."""
        wire = self._encoder.encode(plan)
        if traces:
            wire.traces.extend(traces)
        try:
            if self._stream is None:
                self._stream = await self._open()
            await self._stream.write(wire)
        except BROKEN as exc:
            log.error("round %d: could not send the plan, the round is lost: %s", plan.round_id, exc)
            sent()
            self.drop_stream()
            return False
        sent()
        return True

    async def receive(self, round_id: int) -> RoundResult | None:
        """Read the answer of the oldest round sent (`round_id`); None when the stream broke (dropped)."""
        stream = self._stream
        try:
            if stream is None:
                raise ConnectionError("no round stream")
            result = convert.result_from_proto(await stream.read())
        except BROKEN as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.error("round %d: worker call failed, the round is lost: %s", round_id, detail)
            self.drop_stream()
            return None
        if result.round_id != round_id:
            log.error("round %d: the worker answered round %d instead", round_id, result.round_id)
        if result.error:
            self.metrics.round_errors.inc()
        return result

    async def execute(self, plan: RoundPlan, sent: Callable[[], None],
                      traces: Sequence[worker_pb2.RequestTrace] = ()) -> RoundResult | None:
        """Run one round on the worker, calling `sent()` exactly once, when the plan is on its way; return
        the result, or None when the call broke (the round is lost with the worker; the stream is dropped).

        `traces`: trace contexts of requests the round serves, for the worker's round span to link to."""
        wire = self._encoder.encode(plan)
        if traces:
            wire.traces.extend(traces)
        pending = [sent]  # called exactly once, even when the call breaks before the plan went out
        try:
            if self.use_stream and self._stream is None:
                self._stream = await self._open()
            stream = self._stream
            if stream is None:
                call = self.stub.Execute(wire)
                pending.pop()()
                try:
                    reply = await call
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is not grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    log.error("round %d: the worker refused the plan: %s", plan.round_id, exc.details())
                    self.metrics.round_errors.inc()
                    return RoundResult(plan.round_id, (), 0.0, error=f"INVALID_ARGUMENT: {exc.details()}")
            else:
                await stream.write(wire)
                pending.pop()()
                reply = await stream.read()
            result = convert.result_from_proto(reply)
        except BROKEN as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.error("round %d: worker call failed, the round is lost: %s", plan.round_id, detail)
            for callback in pending:
                callback()
            self.drop_stream()
            return None
        if result.error:
            self.metrics.round_errors.inc()
        return result
