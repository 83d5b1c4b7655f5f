"""The scheduler's I/O loop around the pure `SchedulerCore`.

Theory of operation
- The loop: wait for work -> `core.schedule(now)` -> the worker executes the plan (one long-lived
  ExecuteStream) -> `core.on_round_result(result, now)` -> hand the events over -> repeat.
  The clock is `time.time()`, read here only; the core gets it as `now`.
- Events are handled in two halves. Bookkeeping (span events, metrics, lifecycle timestamps) runs at
  once, in the loop. Publishing to Redis (token deltas per owner, completions, KV event batches) is
  queued to one publisher task, so round N's events go out while round N+1 executes, in order.
  A Redis failure is retried until it succeeds: events are delayed, never dropped.
- Submit and Cancel (RPCs) call the core directly: the event loop is single-threaded, so they
  interleave with the loop only at its awaits, which the core allows (a cancel while a round is in
  flight leaves the request CANCELLING until the result arrives).
- Deadlines: the loop sleeps at most until `core.next_deadline()` and calls `expire` then.
- The worker: a call that breaks fails the round in flight (its requests end FAILED, exactly once,
  with the reason). The driver then runs no rounds until the worker answers again: queued requests
  wait (their deadlines still apply), `worker_serving` is False (Submit refuses new work and the
  router is told UNHEALTHY through `worker_changed`), and the worker's health is probed every
  `worker_retry_s`. The agent also probes it before each heartbeat, so an idle replica notices a
  dead worker too. On recovery a replica with nothing running clears its prefix cache: a restarted
  worker holds no KV, and the router is told so (ALL_CLEARED).
- `rates` measures what rounds take (EWMA of decode round seconds and prefill tokens/s, from each
  successful round's wall time); heartbeats carry them to the router's TTFT prediction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.context import Context

from scheduler_svc import convert
from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.types import (
    CoreEvents,
    Finished,
    LifecycleEvent,
    RequestRejected,
    RequestStatus,
    RoundPlan,
    RoundResult,
    Stage,
)
from sluice import telemetry
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics
from sluice.v1 import common_pb2, events_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from worker_svc import convert as worker_convert
from worker_svc.server import SERVICE_NAME as WORKER_SERVICE

__all__ = ["Driver", "RoundRates"]

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer("sluice.scheduler")

WORKER_UNAVAILABLE = "worker unavailable"

_TERMINAL_EVENT = {
    RequestStatus.FINISHED_STOP: "finished", RequestStatus.FINISHED_LENGTH: "finished",
    RequestStatus.CANCELLED: "cancelled", RequestStatus.TIMED_OUT: "timed_out", RequestStatus.FAILED: "failed",
}


@dataclass
class _Tracked:
    """What the driver keeps per live request: where its tokens go and its trace."""

    owner: str
    span: trace.Span
    trace_fields: dict[str, str]
    timestamps: common_pb2.LifecycleTimestamps
    arrival: float
    last_token_time: float | None = None


@dataclass
class _Outgoing:
    """One batch of Redis publications, in the order they must go out."""

    tokens: dict[str, tuple[list[events_pb2.TokenDelta], list[dict[str, str]]]] = field(default_factory=dict)
    completions: list[tuple[events_pb2.Completion, Context]] = field(default_factory=list)
    kv: events_pb2.KvEventBatch | None = None


def _merge(batches: list[_Outgoing]) -> _Outgoing:
    """Return one batch with everything of `batches`, in order (per owner for tokens; KV events concatenated)."""
    if len(batches) == 1:
        return batches[0]
    merged = _Outgoing()
    for batch in batches:
        for owner, (deltas, fields) in batch.tokens.items():
            have_deltas, have_fields = merged.tokens.setdefault(owner, ([], []))
            have_deltas += deltas
            have_fields += fields
        merged.completions += batch.completions
        if batch.kv is not None:
            if merged.kv is None:
                merged.kv = batch.kv
            else:
                merged.kv.events.extend(batch.kv.events)
    return merged


@dataclass
class RoundRates:
    """What this replica's rounds take, as exponentially weighted averages, for the router's TTFT.

    A round's wall time is modelled as one decode round (when it has decodes) plus its prefill tokens
    at the prefill rate. Decode-only rounds update `decode_round_s`; a round with prefill tokens
    counts its time less one decode round (at least a tenth of the round, so that a noisy decode
    average cannot make the rate absurd). The rate is averaged tokens over averaged seconds, so that
    small chunks do not dominate it.
    """

    alpha: float = 0.2
    """Weight of the newest round."""
    decode_round_s: float = 0.0
    """Average decode-only round, seconds; 0 until one was seen."""
    prefill_tokens: float = 0.0
    """Average prefill tokens of rounds that had some."""
    prefill_s: float = 0.0
    """Average seconds those rounds spent on prefill."""

    @property
    def prefill_tokens_per_s(self) -> float:
        """Return the measured prefill rate in tokens/s; 0 until a round with prefill was seen."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def observe(self, plan: RoundPlan, wall_s: float) -> None:
        """Fold one successful round (its plan and its wall seconds) into the averages."""
        prefill_tokens = decodes = 0
        for seq in plan.seqs:
            if seq.sample and seq.output_index > 0 and len(seq.token_ids) == 1:
                decodes += 1
            else:
                prefill_tokens += len(seq.token_ids)
        if prefill_tokens == 0:
            if decodes:
                self.decode_round_s = self._average(self.decode_round_s, wall_s)
            return
        spent = max(wall_s - (self.decode_round_s if decodes else 0.0), wall_s / 10)
        self.prefill_tokens = self._average(self.prefill_tokens, prefill_tokens)
        self.prefill_s = self._average(self.prefill_s, spent)

    def _average(self, old: float, sample: float) -> float:
        return sample if old == 0.0 else old + self.alpha * (sample - old)


class Driver:
    """Runs one replica's rounds and publishes what the core reports. See the module docstring."""

    def __init__(self, core: SchedulerCore, worker: worker_pb2_grpc.WorkerServiceStub, bus: Bus, *,
                 replica_id: str, model_id: str, eos_token_id: int, metrics: SchedulerMetrics | None = None,
                 clock: Callable[[], float] = time.time, use_stream: bool = True,
                 worker_retry_s: float = 0.5, worker_health: health_pb2_grpc.HealthStub | None = None,
                 publish_first_max_tokens: int = 64) -> None:
        self.core = core
        self.worker = worker
        self.bus = bus
        self.replica_id = replica_id
        self.model_id = model_id
        self.eos_token_id = eos_token_id
        self.metrics = metrics or SchedulerMetrics()
        self.clock = clock
        self.use_stream = use_stream
        self.worker_retry_s = worker_retry_s
        self.worker_health = worker_health
        self.accepting = True
        self.worker_serving = True
        """False while the worker is unreachable (no rounds run; Submit refuses; the router is told)."""
        self.worker_changed = asyncio.Event()
        """Set whenever `worker_serving` changes (the agent heartbeats at once)."""
        self.rates = RoundRates()
        self.publish_first_max_tokens = publish_first_max_tokens
        """A round with at most this many tokens publishes them before the next round is planned; a bigger
        one sends the next plan first (its tokens wait ~ a plan conversion, the worker does not)."""
        self._deferred: tuple[CoreEvents, float] | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._wake = asyncio.Event()
        self._outbox: asyncio.Queue[_Outgoing | None] = asyncio.Queue()
        self._last_stats = core.stats()

    # ---- requests -------------------------------------------------------------------------
    def submit(self, msg: scheduler_pb2.SubmitRequest, parent: Context | None) -> int:
        """Queue a request; return its queue position. Raises RequestRejected (counted by reason)."""
        now = self.clock()
        request = convert.new_request_from_proto(msg, now, self.eos_token_id)
        try:
            self.core.submit(request, now)
        except RequestRejected as exc:
            self.metrics.rejections.labels(exc.reason.value).inc()
            raise
        span = tracer.start_span("replica.request", context=parent, start_time=int(now * 1e9), attributes={
            "sluice.request_id": msg.request_id, "sluice.replica_id": self.replica_id,
            "sluice.tenant": request.tenant, telemetry.GEN_AI_REQUEST_MODEL: self.model_id,
            telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(request.prompt_token_ids)})
        fields = telemetry.inject_fields(trace.set_span_in_context(span))
        timestamps = common_pb2.LifecycleTimestamps()
        timestamps.CopyFrom(msg.timestamps)
        self._tracked[msg.request_id] = _Tracked(msg.owner, span, fields, timestamps, now)
        self._handle(self.core.take_events(), now)
        self._wake.set()
        return self.core.num_waiting

    def cancel(self, request_id: str) -> RequestStatus | None:
        """Cancel a request; return its status afterwards (None for an id the core does not know)."""
        now = self.clock()
        status = self.core.cancel(request_id, now)
        self._handle(self.core.take_events(), now)
        self._wake.set()
        return status

    def live_request_ids(self) -> list[str]:
        """Return the ids of requests not yet terminal."""
        return list(self._tracked)

    # ---- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Schedule rounds until `stop` is set; then flush every queued publication and return."""
        publisher = asyncio.create_task(self._publish_loop())
        stream: grpc.aio.StreamStreamCall | None = None
        try:
            while not stop.is_set():
                if not self.worker_serving:
                    self._flush_deferred()
                    if stream is not None:
                        stream.cancel()
                        stream = None
                    await self._await_worker(stop)
                    continue
                now = self.clock()
                deadline = self.core.next_deadline()
                if deadline is not None and deadline <= now:
                    self.core.expire(now)
                plan = self.core.schedule(now)
                scheduled = self.core.take_events()
                if plan.is_empty:
                    self._handle(scheduled, now)
                    await self._wait_for_work(stop)
                    continue
                stream = await self._round(plan, now, scheduled, stream)
        finally:
            if stream is not None:
                stream.cancel()
            self._flush_deferred()
            await self._outbox.put(None)
            await publisher

    async def _round(self, plan: RoundPlan, now: float, scheduled: CoreEvents,
                     stream: grpc.aio.StreamStreamCall | None) -> grpc.aio.StreamStreamCall | None:
        """Execute one round and hand its events over; return the stream to use next."""
        if self.use_stream and stream is None:
            stream = self.worker.ExecuteStream()
        had_stream = stream is not None
        # The previous round's deferred events and this round's scheduling events are handled once the
        # plan is on its way to the worker: that work overlaps the worker's.
        result, stream = await self._execute(plan, stream, lambda: self._handle(scheduled, now))
        done = self.clock()
        events = self.core.on_round_result(result, done)
        self.metrics.round_duration.observe(done - now)
        if result.error:
            self._handle(events, done)
            if result.error.startswith(WORKER_UNAVAILABLE) or (had_stream and stream is None):
                self._set_worker_serving(False)
            return stream
        self.rates.observe(plan, done - now)
        if len(events.tokens) > self.publish_first_max_tokens:
            # A big round: building and sending its deltas would keep the worker waiting for the next
            # plan (measured ~0.85 ms at 256 sequences); they go out right after that plan instead.
            self._deferred = (events, done)
            return stream
        if self._queue_tokens(events, done):
            # Let the publisher put this round's tokens on the wire before any other work. Two turns of the
            # loop: redis-py writes a command in a task of its own (asyncio.wait_for with socket_timeout),
            # so the bytes leave at the publisher's second step, not its first.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        self._handle(events, done)
        return stream

    def _flush_deferred(self) -> None:
        """Hand over the deferred events of the last big round (before any later event, to keep order)."""
        if self._deferred is not None:
            events, done = self._deferred
            self._deferred = None
            self._handle(events, done)

    # ---- the worker's health --------------------------------------------------------------
    def _set_worker_serving(self, serving: bool) -> None:
        if serving != self.worker_serving:
            self.worker_serving = serving
            self.worker_changed.set()
            self._wake.set()
            if serving:
                log.info("the worker answers again: running rounds")
            else:
                log.error("the worker is unavailable: no rounds until it answers; %d requests wait",
                          self.core.num_waiting)

    async def probe_worker(self) -> bool:
        """Ask the worker whether it serves (gRPC health, else Info); update `worker_serving` when it went
        away; return the answer. A worker coming back is taken up by the loop, which resets the cache."""
        try:
            if self.worker_health is not None:
                reply = await self.worker_health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                       timeout=2.0)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            else:
                await self.worker.Info(worker_pb2.InfoRequest(), timeout=2.0)
                serving = True
        except grpc.aio.AioRpcError:
            serving = False
        if not serving:
            self._set_worker_serving(False)
        return serving

    async def _await_worker(self, stop: asyncio.Event) -> None:
        """Run no rounds until the worker serves again (or `stop`); queued requests still time out."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.worker_retry_s)
            now = self.clock()
            deadline = self.core.next_deadline()
            if deadline is not None and deadline <= now:
                self.core.expire(now)
                self._handle(self.core.take_events(), now)
            if not stop.is_set() and await self.probe_worker():
                self._on_worker_back()
                return

    def _on_worker_back(self) -> None:
        if self.core.num_running == 0:
            # A restarted worker holds no KV: forget the cached prefixes (the router gets ALL_CLEARED).
            self.core.pool.reset_cache()
            self._handle(self.core.take_events(), self.clock())
        else:
            log.warning("the worker is back while %d requests still run: their KV may be gone",
                        self.core.num_running)
        self._set_worker_serving(True)

    async def _execute(self, plan: RoundPlan, stream: grpc.aio.StreamStreamCall | None, sent: Callable[[], None]
                       ) -> tuple[RoundResult, grpc.aio.StreamStreamCall | None]:
        """Run one round on the worker, calling `sent()` once the plan is on its way; a broken call becomes
        a failed round (and the stream is dropped)."""
        wire = worker_convert.plan_to_proto(plan)
        pending = [sent]  # called exactly once, even when the call breaks before the plan went out
        try:
            if stream is None:
                call = self.worker.Execute(wire)
                pending.pop()()
                reply = await call
            else:
                await stream.write(wire)
                pending.pop()()
                reply = await stream.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("the worker closed the round stream")
            result = worker_convert.result_from_proto(reply)
        except (grpc.aio.AioRpcError, ConnectionError) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.error("round %d: worker call failed: %s", plan.round_id, detail)
            for callback in pending:
                callback()
            if stream is not None:
                stream.cancel()
            return RoundResult(plan.round_id, (), error=f"{WORKER_UNAVAILABLE}: {detail}"), None
        if result.error:
            self.metrics.round_errors.inc()
        return result, stream

    async def _wait_for_work(self, stop: asyncio.Event) -> None:
        """Sleep until a submit/cancel, `stop`, or the next deadline."""
        self._wake.clear()
        deadline = self.core.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - self.clock())
        waiters = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    # ---- events: bookkeeping now, publishing queued ---------------------------------------
    def _queue_tokens(self, events: CoreEvents, now: float) -> bool:
        """Queue the events' token deltas for publishing (and take them out of `events`); True if any."""
        if not events.tokens:
            return False
        out = _Outgoing()
        self._on_tokens(events, now, out)
        events.tokens = []
        if not out.tokens:
            return False
        self._outbox.put_nowait(out)
        return True

    def _handle(self, events: CoreEvents, now: float) -> None:
        self._flush_deferred()
        # Tokens first: a request's completion must never be queued ahead of its last tokens.
        self._queue_tokens(events, now)
        for event in events.lifecycle:
            self._on_lifecycle(event)
        out = _Outgoing()
        for finished in events.finished:
            self._on_finished(finished, out)
        if events.kv_events:
            out.kv = convert.kv_batch_to_proto(self.replica_id, events.kv_events)
        if events.dropped_results:
            self.metrics.dropped_results.inc(events.dropped_results)
        self._update_gauges()
        if out.completions or out.kv is not None:
            self._outbox.put_nowait(out)

    def _on_lifecycle(self, event: LifecycleEvent) -> None:
        tracked = self._tracked.get(event.request_id)
        if tracked is None:
            return
        stage = event.stage
        name = stage.value
        if stage is Stage.FINISHED:
            status = dict(event.detail).get("status", "")
            name = _TERMINAL_EVENT.get(RequestStatus(status), "finished") if status else name
        elif stage is Stage.CANCEL_REQUESTED:
            tracked.timestamps.cancel_requested = event.time
        elif stage is Stage.KV_RELEASED:
            tracked.timestamps.kv_released = event.time
        elif stage is Stage.FIRST_TOKEN:
            self.metrics.ttft.observe(event.time - tracked.arrival)
        elif stage is Stage.PREEMPTED:
            self.metrics.preemptions.inc()
        tracked.span.add_event(name, attributes=dict(event.detail), timestamp=int(event.time * 1e9))

    def _on_tokens(self, events: CoreEvents, now: float, out: _Outgoing) -> None:
        for delta in convert.token_deltas(events.tokens, now):
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:  # the core never reports tokens of a request it did not get from us
                log.error("tokens for untracked request %s", delta.request_id)
                continue
            if tracked.last_token_time is not None:
                self.metrics.itl.observe(now - tracked.last_token_time)
            tracked.last_token_time = now
            deltas, fields = out.tokens.setdefault(tracked.owner, ([], []))
            deltas.append(delta)
            fields.append(tracked.trace_fields)

    def _on_finished(self, finished: Finished, out: _Outgoing) -> None:
        tracked = self._tracked.pop(finished.request_id, None)
        if tracked is None:
            log.error("finished record for untracked request %s", finished.request_id)
            return
        completion = convert.completion_to_proto(finished, replica_id=self.replica_id, owner=tracked.owner,
                                                 timestamps=tracked.timestamps)
        self._observe_finished(finished)
        span = tracked.span
        span.set_attribute(telemetry.GEN_AI_USAGE_OUTPUT_TOKENS, finished.usage.output_tokens)
        span.set_attribute(telemetry.GEN_AI_RESPONSE_FINISH_REASONS, [finished.finish_reason])
        span.set_attribute("sluice.status", finished.status.value)
        span.set_attribute("sluice.preemptions", finished.usage.preemptions)
        if finished.status is RequestStatus.FAILED:
            span.set_status(trace.Status(trace.StatusCode.ERROR, finished.detail))
        end = max(finished.finish_time, tracked.timestamps.kv_released)
        span.end(end_time=int(end * 1e9))
        out.completions.append((completion, trace.set_span_in_context(span)))

    def _observe_finished(self, finished: Finished) -> None:
        m = self.metrics
        m.finished.labels(finished.finish_reason).inc()
        m.request_duration.observe(finished.finish_time - finished.arrival_time)
        if finished.status is RequestStatus.CANCELLED:
            m.cancellations.inc()
        elif finished.status is RequestStatus.TIMED_OUT:
            m.timeouts.inc()
        outputs = finished.usage.output_tokens
        if finished.first_token_time is not None and outputs > 1:
            m.tpot.observe((finished.finish_time - finished.first_token_time) / (outputs - 1))

    def _update_gauges(self) -> None:
        stats, last, m = self.core.stats(), self._last_stats, self.metrics
        m.queue_length.set(stats.waiting)
        m.running.set(stats.running)
        m.kv_blocks_used.set(stats.kv_blocks_used)
        m.kv_blocks_free.set(stats.kv_blocks_free)
        m.kv_blocks_cached.set(stats.kv_blocks_cached)
        m.rounds.inc(stats.rounds - last.rounds)
        m.recomputed_tokens.inc(stats.recomputed_tokens - last.recomputed_tokens)
        m.prefix_hit_tokens.inc(stats.prefix_hit_tokens - last.prefix_hit_tokens)
        m.prefix_query_tokens.inc(stats.prefix_query_tokens - last.prefix_query_tokens)
        self._last_stats = stats

    # ---- publishing -----------------------------------------------------------------------
    async def _publish_loop(self) -> None:
        """Publish queued batches in order until the None sentinel; retry Redis failures forever.

        Whatever queued up while the previous publication was in flight goes out merged, in one
        call per owner: under load the queue drains in a few round trips instead of growing.
        """
        while True:
            batches = [await self._outbox.get()]
            while not self._outbox.empty():
                batches.append(self._outbox.get_nowait())
            last = batches[-1] is None
            out = _merge([b for b in batches if b is not None])
            try:
                delay = 0.05
                while True:
                    try:
                        await self._publish(out)
                        break
                    except Exception as exc:  # Redis down: keep what is left of the batch, in order
                        log.error("publishing to Redis failed (%s); retrying in %.2f s", exc, delay)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 2.0)
            finally:
                for _ in batches:
                    self._outbox.task_done()
            if last:
                return

    async def _publish(self, out: _Outgoing) -> None:
        """Publish a batch; what went out is removed from it, so a retry resumes where it failed."""
        while out.tokens:
            owner, (deltas, fields) = next(iter(out.tokens.items()))
            if owner:
                await self.bus.publish_tokens(owner, deltas, trace_fields=fields)
            del out.tokens[owner]
        # Tokens before completions: an owner never sees a request end before its last tokens.
        while out.completions:
            completion, context = out.completions[0]
            await self.bus.publish_completion(completion, context=context)
            out.completions.pop(0)
        if out.kv is not None:
            await self.bus.publish_kv(out.kv)
            out.kv = None

    async def flush(self) -> None:
        """Wait until every publication queued so far has been handed to Redis."""
        await self._outbox.join()
