"""What the replica does with the core's events: bookkeeping at once, publications queued.

Bookkeeping (span events, metrics, lifecycle timestamps, gauges) runs in the loop as the events are
handed over; what goes to Redis is queued to the `Publisher`. Order is kept throughout: a request's
tokens are queued before its completion, and the events of a deferred (big) round are handed over
before any later event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from scheduler_svc.core import SchedulerCore
from scheduler_svc.publisher import Outgoing, Publisher
from sluice import convert, telemetry
from sluice.prom import SchedulerMetrics
from sluice.types import (
    CoreEvents,
    Finished,
    LifecycleEvent,
    NewRequest,
    RequestStatus,
    RequestTotals,
    RoundPlan,
    Stage,
)
from sluice.v1 import common_pb2, scheduler_pb2, worker_pb2

__all__ = ["MAX_ROUND_TRACES", "Reporter"]

MAX_ROUND_TRACES = 32
"""Requests whose trace context one round carries to the worker (its round span links to them): a bound, so
that tracing costs a round O(1), not O(batch). Prefill chunks come first (see `round_traces`)."""

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer("sluice.scheduler")

_TERMINAL_EVENT = {
    RequestStatus.FINISHED_STOP: "finished", RequestStatus.FINISHED_LENGTH: "finished",
    RequestStatus.CANCELLED: "cancelled", RequestStatus.TIMED_OUT: "timed_out", RequestStatus.FAILED: "failed",
}


@dataclass
class _Tracked:
    """What the replica keeps per live request: where its tokens go and its trace."""

    owner: str
    span: trace.Span
    trace_fields: dict[str, str]
    round_trace: worker_pb2.RequestTrace | None
    """What a round carries to the worker for this request; None when its span is not sampled."""
    timestamps: common_pb2.LifecycleTimestamps
    arrival: float
    prompt_tokens: int = 0
    last_token_time: float | None = None
    token_rounds: int = 0
    """Rounds (hand-overs) that brought this request tokens here."""


FIRST_ROUNDS_AT_ONCE = 4
"""A request's tokens of its first this many rounds here go out at once, whatever the publication interval: its first
visible text may need several tokens (a character split over byte tokens, which admission's detokenizer holds), and
a client's time to first token is that text's."""


class Reporter:
    """Turns core events into metrics, spans and queued publications, per tracked request."""

    def __init__(self, core: SchedulerCore, publisher: Publisher, metrics: SchedulerMetrics, replica_id: str) -> None:
        self.core = core
        self.publisher = publisher
        self.metrics = metrics
        self.replica_id = replica_id
        self._tracked: dict[str, _Tracked] = {}
        self._sampled = 0
        """Tracked requests whose span is sampled (none: rounds carry no trace context at all)."""
        self._deferred: tuple[CoreEvents, float] | None = None
        self._last_stats = core.stats()
        self._gauges_unset = True
        """No gauge written yet: the first update writes every one."""
        self.totals = RequestTotals()
        """What the Stats RPC reports of the requests taken (sluice.types.RequestTotals)."""

    def track(self, request_id: str, owner: str, span: trace.Span, timestamps: common_pb2.LifecycleTimestamps,
              arrival: float, prompt_tokens: int = 0) -> None:
        """Start tracking a submitted request (its tokens go to `owner`, its events to `span`)."""
        fields = telemetry.inject_fields(trace.set_span_in_context(span))
        round_trace = None
        if span.get_span_context().trace_flags.sampled and "traceparent" in fields:
            round_trace = worker_pb2.RequestTrace(request_id=request_id, traceparent=fields["traceparent"],
                                                  tracestate=fields.get("tracestate", ""))
            self._sampled += 1
        self._tracked[request_id] = _Tracked(owner, span, fields, round_trace, timestamps, arrival, prompt_tokens)

    def track_submitted(self, msg: scheduler_pb2.SubmitRequest, request: NewRequest, parent: Context | None,
                        now: float, model_id: str, engine: str) -> None:
        """Open the replica's span of a request the core accepted (a child of admission's, from `parent`) and
        track it: the one way both engines' drivers start reporting a request."""
        span = tracer.start_span("replica.request", context=parent, start_time=int(now * 1e9), attributes={
            "sluice.request_id": msg.request_id, "sluice.replica_id": self.replica_id, "sluice.engine": engine,
            "sluice.tenant": request.tenant, telemetry.GEN_AI_REQUEST_MODEL: model_id,
            telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(request.prompt_token_ids)})
        timestamps = common_pb2.LifecycleTimestamps()
        timestamps.CopyFrom(msg.timestamps)
        self.track(msg.request_id, msg.owner, span, timestamps, now, len(request.prompt_token_ids))
        self.totals.input_tokens += len(request.prompt_token_ids)
        self.totals.max_output_tokens += msg.sampling.max_tokens

    def round_traces(self, plan: RoundPlan) -> list[worker_pb2.RequestTrace]:
        """Return the trace contexts the round `plan` carries to the worker: sampled requests only, at most
        MAX_ROUND_TRACES, prefill chunks first (the core plans decodes first, so the plan is read backwards)."""
        if not self._sampled:
            return []
        traces: list[worker_pb2.RequestTrace] = []
        tracked = self._tracked
        for seq in reversed(plan.seqs):
            entry = tracked.get(seq.request_id)
            if entry is not None and entry.round_trace is not None:
                traces.append(entry.round_trace)
                if len(traces) == MAX_ROUND_TRACES:
                    break
        return traces

    def live_request_ids(self) -> list[str]:
        """Return the ids of tracked requests not yet terminal."""
        return list(self._tracked)

    def defer(self, events: CoreEvents, now: float) -> None:
        """Keep a big round's events to hand over later (before any later event)."""
        self.flush_deferred()
        self._deferred = (events, now)

    def flush_deferred(self) -> None:
        """Hand over the deferred events, if any."""
        if self._deferred is not None:
            events, done = self._deferred
            self._deferred = None
            self.handle(events, done)

    def queue_tokens(self, events: CoreEvents, now: float) -> bool:
        """Queue the events' token deltas for publishing (and take them out of `events`); True if any."""
        if not events.tokens:
            return False
        out = Outgoing()
        self._on_tokens(events, now, out)
        events.tokens = []
        if not out.tokens:
            return False
        self.publisher.put(out)
        return True

    def handle(self, events: CoreEvents, now: float) -> None:
        """Do the bookkeeping of `events` and queue their publications (after any deferred ones)."""
        self.flush_deferred()
        # Tokens first: a request's completion must never be queued ahead of its last tokens.
        self.queue_tokens(events, now)
        for event in events.lifecycle:
            self._on_lifecycle(event)
        out = Outgoing()
        for finished in events.finished:
            self._on_finished(finished, out)
        if events.kv_events:
            config = self.core.config
            out.kv = convert.kv_batch_to_proto(self.replica_id, events.kv_events, block_size=config.block_size,
                                               lora_name=config.adapter_version, ts=now)
        if events.dropped_results:
            self.metrics.dropped_results.inc(events.dropped_results)
        self._update_gauges()
        if out.completions or out.kv is not None:
            self.publisher.put(out)

    def _on_lifecycle(self, event: LifecycleEvent) -> None:
        tracked = self._tracked.get(event.request_id)
        if tracked is None:
            return
        stage = event.stage
        name = stage.value
        attributes = dict(event.detail)
        if stage is Stage.FINISHED:
            status = attributes.get("status", "")
            if status:
                name = _TERMINAL_EVENT.get(RequestStatus(status), "finished")
                attributes["status"] = RequestStatus(status).name  # one spelling across services
        elif stage is Stage.CANCEL_REQUESTED:
            tracked.timestamps.cancel_requested = event.time
        elif stage is Stage.KV_RELEASED:
            tracked.timestamps.kv_released = event.time
        elif stage is Stage.FIRST_TOKEN:
            ttft = event.time - tracked.arrival
            self.metrics.ttft.observe(ttft)
            self.totals.ttft_s += ttft
            self.totals.ttft_count += 1
            self.metrics.prompt_tokens.inc(tracked.prompt_tokens)
        elif stage is Stage.FIRST_SCHEDULED:
            self.metrics.queue_time.observe(event.time - tracked.arrival)
        elif stage is Stage.PREEMPTED:
            self.metrics.preemptions.inc()
        tracked.span.add_event(name, attributes=attributes, timestamp=int(event.time * 1e9))

    def _on_tokens(self, events: CoreEvents, now: float, out: Outgoing) -> None:
        """Queue the events' tokens as one TokenDeltaBatch per owner (one Redis entry each); observe each
        request's inter-token latency (one gap per request that had a token before, fed in bulk: the histograms
        count exactly what one observation each would)."""
        self.metrics.generation_tokens.inc(len(events.tokens))
        tracked_of = self._tracked.get
        gaps: list[float] = []
        itl = gaps.append

        def owner_of(request_id: str) -> str | None:
            tracked = tracked_of(request_id)
            if tracked is None:  # the core never reports tokens of a request it did not get from us
                log.error("tokens for untracked request %s", request_id)
                return None
            if tracked.last_token_time is not None:
                itl(now - tracked.last_token_time)
            if tracked.token_rounds < FIRST_ROUNDS_AT_ONCE:  # never held back by the publication interval (TTFT)
                out.urgent = True
                tracked.token_rounds += 1
            tracked.last_token_time = now
            return tracked.owner

        for owner, batch in convert.token_delta_batches(events.tokens, now, owner_of,
                                                               events.logprobs).items():
            have = out.tokens.get(owner)
            if have is None:
                out.tokens[owner] = batch
            else:
                have.deltas.extend(batch.deltas)
        self.metrics.itl.observe_many(gaps)

    def _on_finished(self, finished: Finished, out: Outgoing) -> None:
        tracked = self._tracked.pop(finished.request_id, None)
        if tracked is None:
            log.error("finished record for untracked request %s", finished.request_id)
            return
        if tracked.round_trace is not None:
            self._sampled -= 1
        completion = convert.completion_to_proto(finished, replica_id=self.replica_id, owner=tracked.owner,
                                                 timestamps=tracked.timestamps)
        self._observe_finished(finished)
        span = tracked.span
        span.set_attribute(telemetry.GEN_AI_USAGE_OUTPUT_TOKENS, finished.usage.output_tokens)
        span.set_attribute(telemetry.GEN_AI_RESPONSE_FINISH_REASONS, [finished.finish_reason])
        span.set_attribute("sluice.preemptions", finished.usage.preemptions)
        end = max(finished.finish_time, tracked.timestamps.kv_released)
        telemetry.end_request_span(span, finished.status.name, finished.detail, end_time=int(end * 1e9))
        context: Context = trace.set_span_in_context(span)
        out.completions.append((completion, context))

    def _observe_finished(self, finished: Finished) -> None:
        m = self.metrics
        m.finished.labels(finished.finish_reason).inc()
        m.request_success(finished.finish_reason)
        m.request_duration.observe(finished.finish_time - finished.arrival_time)
        if finished.status is RequestStatus.CANCELLED:
            m.cancellations.inc()
        elif finished.status is RequestStatus.TIMED_OUT:
            m.timeouts.inc()
        outputs = finished.usage.output_tokens
        if finished.first_token_time is not None and outputs > 1:
            tpot = (finished.finish_time - finished.first_token_time) / (outputs - 1)
            m.tpot.observe(tpot)
            self.totals.tpot_s += tpot
            self.totals.tpot_count += 1

    def _update_gauges(self) -> None:
        """Bring the gauges and the core's counters up to date; only what changed since the last call is written
        (each write takes a lock, twice with vLLM's twin; a decode round changes little but the round count)."""
        stats, last, m, fresh = self.core.stats(), self._last_stats, self.metrics, self._gauges_unset
        if fresh or stats.waiting != last.waiting:
            m.queue_length.set(stats.waiting)
        if fresh or stats.running != last.running:
            m.running.set(stats.running)
        if fresh or (stats.kv_blocks_used, stats.kv_blocks_free, stats.kv_blocks_cached) != (
                last.kv_blocks_used, last.kv_blocks_free, last.kv_blocks_cached):
            m.kv_blocks_used.set(stats.kv_blocks_used)
            m.kv_blocks_free.set(stats.kv_blocks_free)
            m.kv_blocks_cached.set(stats.kv_blocks_cached)
            m.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        if fresh or stats.host_blocks_cached != last.host_blocks_cached or stats.host_blocks_used != last.host_blocks_used:
            m.host_blocks_cached.set(stats.host_blocks_cached)
            m.host_blocks_used.set(stats.host_blocks_used)
        for counter, now, then in ((m.rounds, stats.rounds, last.rounds),
                                   (m.recomputed_tokens, stats.recomputed_tokens, last.recomputed_tokens),
                                   (m.prefix_hit_tokens, stats.prefix_hit_tokens, last.prefix_hit_tokens),
                                   (m.prefix_query_tokens, stats.prefix_query_tokens, last.prefix_query_tokens),
                                   (m.host_prefix_hit_tokens, stats.host_hit_tokens, last.host_hit_tokens)):
            if now != then:
                counter.inc(now - then)
        self._last_stats, self._gauges_unset = stats, False
