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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice import convert, services
from sluice.plan_encoder import PlanEncoder
from sluice.prom import SchedulerMetrics
from sluice.types import RoundPlan, RoundResult
from sluice.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerLink"]

log = logging.getLogger(__name__)


class WorkerLink:
    """One worker, as the round loop sees it. See the module docstring."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, *, metrics: SchedulerMetrics,
                 health: health_pb2_grpc.HealthStub | None = None, use_stream: bool = True,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.stub = stub
        self.health = health
        self.metrics = metrics
        self.use_stream = use_stream
        self.on_change = on_change
        self.serving = True
        """False while the worker is unreachable (no rounds run; Submit refuses; the router is told)."""
        self.changed = asyncio.Event()
        """Set whenever `serving` changes."""
        self._stream: grpc.aio.StreamStreamCall | None = None
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
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

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
        return reply.incarnation

    async def send(self, plan: RoundPlan, sent: Callable[[], None],
                   traces: Sequence[worker_pb2.RequestTrace] = ()) -> bool:
        """Write `plan` on the round stream (opened if needed) without waiting for its answer; call `sent()`
        exactly once; return False when the stream broke (the stream is dropped)."""
        if self._stream is None:
            self._stream = self.stub.ExecuteStream()
        wire = self._encoder.encode(plan)
        if traces:
            wire.traces.extend(traces)
        try:
            await self._stream.write(wire)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError, asyncio.InvalidStateError) as exc:
            # InvalidStateError: the call ended (the worker went away) after the last answer was read.
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
            reply = await stream.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("the worker closed the round stream")
            result = convert.result_from_proto(reply)
        except (grpc.aio.AioRpcError, ConnectionError) as exc:
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
        if self.use_stream and self._stream is None:
            self._stream = self.stub.ExecuteStream()
        stream = self._stream
        wire = self._encoder.encode(plan)
        if traces:
            wire.traces.extend(traces)
        pending = [sent]  # called exactly once, even when the call breaks before the plan went out
        try:
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
                if reply is grpc.aio.EOF:
                    raise ConnectionError("the worker closed the round stream")
            result = convert.result_from_proto(reply)
        except (grpc.aio.AioRpcError, ConnectionError, asyncio.InvalidStateError) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.error("round %d: worker call failed, the round is lost: %s", plan.round_id, detail)
            for callback in pending:
                callback()
            self.drop_stream()
            return None
        if result.error:
            self.metrics.round_errors.inc()
        return result
