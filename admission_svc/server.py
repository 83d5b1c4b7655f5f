"""The admission service: AdmissionService (Generate, Cancel, GetRequest) around AdmissionCore.

Each Generate: authenticate the API key -> tenant; an idempotency key already seen for that
tenant attaches to the request it started (replaying its tokens); otherwise tokenize, validate,
reserve (AdmissionCore.admit), hash the prompt's blocks, Route, Submit to the chosen scheduler
with this process as the token owner, and stream tokens from the process's reader loop. The
reservation is released exactly once, when the completion arrives (or at once when routing or
submitting fails). A client that goes away or whose deadline passes cancels the request at its
scheduler.

Other tenants' requests are NOT_FOUND to Cancel and GetRequest (not PERMISSION_DENIED), so that a
tenant cannot probe which request ids exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from admission_svc import convert
from admission_svc.core import AdmissionCore
from admission_svc.streams import RequestStream, StreamRegistry
from sluice import convert as shared_convert
from sluice import errors, telemetry
from sluice.core_errors import CoreError, OverBudget
from sluice.hashing import hash_chain, salt_of
from sluice.model_spec import ModelSpec
from sluice.prom import REQUEST_DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from sluice.tokenizer import Detokenizer
from sluice.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    events_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16
DOWNSTREAM_TIMEOUT_S = 10.0


class AdmissionMetrics:
    """Prometheus metrics of one admission process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("sluice_admission_requests", "Generate calls, by tenant and outcome.",
                                ["tenant", "outcome"], registry=r)
        self.rejections = Counter("sluice_admission_rejections", "Refused requests, by reason.", ["reason"],
                                  registry=r)
        self.active = Gauge("sluice_admission_active_requests", "Admitted, not terminal.", registry=r)
        self.ttft = Histogram("sluice_admission_time_to_first_token_seconds", "Received to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("sluice_admission_time_per_output_token_seconds", "Per token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("sluice_admission_request_duration_seconds", "Received to terminal.",
                                  buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.cancellations = Counter("sluice_admission_cancellations", "Cancels sent, by cause.", ["cause"],
                                     registry=r)
        self.missing_tokens = Counter("sluice_admission_missing_tokens",
                                      "Tokens a completion counted that never arrived.", registry=r)


@dataclass
class Tracked:
    """What admission remembers about one request it admitted."""

    request_id: str
    tenant: str
    input_tokens: int
    stream: RequestStream
    span: trace.Span
    received_s: float
    timestamps: common_pb2.LifecycleTimestamps = field(default_factory=common_pb2.LifecycleTimestamps)
    status: common_pb2.RequestStatus = common_pb2.WAITING
    replica_id: str = ""
    scheduler_address: str = ""
    completion: events_pb2.Completion | None = None
    ended: bool = False
    followers: int = 0
    """Generate calls streaming this request now (an idempotent retry is a second follower)."""


def _api_key(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else value.strip()
    return None


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """The front door; thin around AdmissionCore, the router, the schedulers and the token streams."""

    def __init__(self, core: AdmissionCore, model: ModelSpec, router_address: str, owner: str,
                 metrics: AdmissionMetrics | None = None, resume_window_s: float = 60.0) -> None:
        self.core = core
        self.model = model
        self.owner = owner
        self.metrics = metrics or AdmissionMetrics()
        self.registry = StreamRegistry(resume_window_s, listener=self)
        self.records: dict[str, Tracked] = {}
        self._router_channel = grpc.aio.insecure_channel(router_address)
        self.router = router_pb2_grpc.RouterServiceStub(self._router_channel)
        self._schedulers: dict[str, tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerServiceStub]] = {}
        self._block_size: tuple[float, int] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tracer = telemetry.get_tracer("sluice.admission")

    # ---- RPCs ---------------------------------------------------------------------------------
    async def Generate(self, request: admission_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[admission_pb2.GenerateChunk]:
        """Stream a generation (see the module docstring); errors become statuses in the interceptor."""
        received = time.time()
        tenant = self.core.authenticate(_api_key(context.invocation_metadata()))
        record = self._attach(tenant, request.idempotency_key)
        attached = record is not None
        if record is None:
            record = await self._admit(request, tenant, context, received)
        self.metrics.requests.labels(tenant, "attached" if attached else "admitted").inc()
        async for message in self._stream(record, context):
            yield message

    async def Cancel(self, request: admission_pb2.CancelGenerationRequest,
                     context: grpc.aio.ServicerContext) -> admission_pb2.CancelGenerationResponse:
        """Cancel one of the caller's requests; returns its status (terminal ones are left as they are)."""
        record = self._own_record(request.request_id, context)
        if record.completion is not None:
            return admission_pb2.CancelGenerationResponse(status=record.completion.status)
        status = await self._cancel_downstream(record, "client")
        return admission_pb2.CancelGenerationResponse(status=status)

    async def GetRequest(self, request: admission_pb2.GetRequestRequest,
                         context: grpc.aio.ServicerContext) -> admission_pb2.RequestInfo:
        """Return one of the caller's requests (status, usage, timestamps, replica)."""
        record = self._own_record(request.request_id, context)
        return convert.request_info(record.request_id, record.status, record.completion, record.replica_id,
                                    record.timestamps)

    def _own_record(self, request_id: str, context: grpc.aio.ServicerContext) -> Tracked:
        tenant = self.core.authenticate(_api_key(context.invocation_metadata()))
        record = self.records.get(request_id)
        if record is None or record.tenant != tenant:
            raise errors.NotFound(f"request {request_id!r} not found", reason="unknown_request")
        return record

    # ---- admission --------------------------------------------------------------------------------
    def _attach(self, tenant: str, key: str) -> Tracked | None:
        if not key:
            return None
        request_id = self.core.lookup_key(tenant, key, time.monotonic())
        return self.records.get(request_id) if request_id else None

    def _prompt_ids(self, request: admission_pb2.GenerateRequest) -> list[int]:
        if request.prompt and request.prompt_token_ids:
            raise errors.InvalidArgument("give either prompt or prompt_token_ids, not both",
                                         reason="invalid_request", field_name="prompt_token_ids")
        if not request.prompt_token_ids:
            return self.model.encode_prompt(request.prompt)
        ids = list(request.prompt_token_ids)
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise errors.InvalidArgument(f"prompt_token_ids holds {len(bad)} ids outside [0, {self.model.vocab_size}),"
                                         f" e.g. {bad[0]}", reason="invalid_request", field_name="prompt_token_ids")
        return ids

    async def _admit(self, request: admission_pb2.GenerateRequest, tenant: str,
                     context: grpc.aio.ServicerContext, received: float) -> Tracked:
        if not self.model.accepts(request.model):
            self.metrics.rejections.labels("unknown_model").inc()
            raise errors.NotFound(f"unknown model {request.model!r}; this deployment serves "
                                  f"{self.model.model_id!r}", reason="unknown_model", field_name="model")
        ids = self._prompt_ids(request)
        try:
            self.core.validate(len(ids), request.sampling.max_tokens, **shared_convert.sampling_values(request.sampling))
        except CoreError as exc:
            self.metrics.rejections.labels(exc.reason).inc()
            raise
        record = self._reserve(request, tenant, ids, received, context)
        try:
            await self._route_and_submit(record, request, ids, context)
        except BaseException as exc:
            self._abandon(record, exc)
            if isinstance(exc, grpc.aio.AioRpcError):
                raise convert.error_from_downstream(exc, "could not place the request") from None
            raise
        return record

    def _reserve(self, request: admission_pb2.GenerateRequest, tenant: str, ids: list[int], received: float,
                 context: grpc.aio.ServicerContext) -> Tracked:
        """Admit (no await between the key lookup and here, so two retries cannot both start)."""
        request_id = uuid.uuid4().hex
        parent: Context = telemetry.extract_metadata(context.invocation_metadata())
        span = self._tracer.start_span("admission.request", context=parent, kind=trace.SpanKind.SERVER,
                                       start_time=_ns(received), attributes={
                                           telemetry.GEN_AI_REQUEST_MODEL: self.model.model_id,
                                           telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(ids),
                                           "sluice.request_id": request_id, "sluice.tenant": tenant,
                                           "sluice.priority": request.priority,
                                           "gen_ai.request.max_tokens": request.sampling.max_tokens})
        span.add_event("received", timestamp=_ns(received))
        try:
            self.core.admit(request_id, tenant, len(ids), request.sampling.max_tokens, time.monotonic())
        except OverBudget as exc:
            self.metrics.rejections.labels(exc.budget).inc()
            span.add_event("rejected", attributes={"reason": exc.budget})
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.detail))
            span.end()
            raise
        now = time.time()
        span.add_event("admitted", timestamp=_ns(now))
        if request.idempotency_key:
            self.core.remember_key(tenant, request.idempotency_key, request_id, time.monotonic())
        record = Tracked(request_id, tenant, len(ids), self.registry.open(request_id), span, received)
        record.timestamps.received, record.timestamps.admitted = received, now
        self.records[request_id] = record
        self.metrics.active.inc()
        return record

    async def _block_size_now(self) -> int:
        cached = self._block_size
        if cached is not None and time.monotonic() - cached[0] < 5.0:
            return cached[1]
        size = DEFAULT_BLOCK_SIZE
        with contextlib.suppress(grpc.aio.AioRpcError):
            listed = await self.router.ListReplicas(router_pb2.ListReplicasRequest(), timeout=DOWNSTREAM_TIMEOUT_S)
            sizes = [r.block_size for r in listed.replicas if r.block_size > 0 and self.model.accepts(r.model)]
            size = sizes[0] if sizes else size
        self._block_size = (time.monotonic(), size)
        return size

    async def _route_and_submit(self, record: Tracked, request: admission_pb2.GenerateRequest, ids: list[int],
                                context: grpc.aio.ServicerContext) -> None:
        span_context = trace.set_span_in_context(record.span)
        metadata = tuple(telemetry.inject_metadata(span_context))
        block_size = await self._block_size_now()
        hashes = hash_chain(ids, block_size, salt_of(self.model.model_id, request.adapter_version))
        route = await self.router.Route(router_pb2.RouteRequest(
            request_id=record.request_id, model=self.model.model_id, adapter_version=request.adapter_version,
            block_hashes=hashes, prompt_tokens=len(ids), max_tokens=request.sampling.max_tokens),
            metadata=metadata, timeout=DOWNSTREAM_TIMEOUT_S)
        record.timestamps.routed = time.time()
        record.replica_id, record.scheduler_address = route.replica_id, route.scheduler_address
        record.span.add_event("routed", timestamp=_ns(record.timestamps.routed), attributes={
            "sluice.replica_id": route.replica_id, "sluice.cached_blocks": route.cached_blocks,
            "sluice.predicted_ttft_s": route.predicted_ttft_s})
        remaining = context.time_remaining()
        deadline = time.time() + remaining if remaining is not None else 0.0
        submit = convert.submit_request(record.request_id, record.tenant, ids, request, self.owner, deadline,
                                        self.model, record.timestamps,
                                        self.core.tenant_weight(record.tenant))
        await self._scheduler(route.scheduler_address).Submit(submit, metadata=metadata,
                                                              timeout=DOWNSTREAM_TIMEOUT_S)
        record.status = common_pb2.WAITING
        record.span.add_event("submitted")

    def _abandon(self, record: Tracked, exc: BaseException) -> None:
        """Undo an admission whose routing or submission failed: release, forget, end the span."""
        self.core.release(record.request_id, time.monotonic())
        self.metrics.active.dec()
        self.records.pop(record.request_id, None)
        record.status = common_pb2.REJECTED
        # An idempotent retry may already follow this request: end its stream too.
        record.stream.set_completion(events_pb2.Completion(
            request_id=record.request_id, tenant=record.tenant, status=common_pb2.REJECTED,
            finish_reason="rejected", detail=f"could not place the request: {str(exc)[:200]}"))
        record.stream.complete_if_ready()
        record.span.add_event("rejected", attributes={"reason": type(exc).__name__})
        record.span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)[:200]))
        record.span.end()
        record.ended = True

    def _scheduler(self, address: str) -> scheduler_pb2_grpc.SchedulerServiceStub:
        if address not in self._schedulers:
            channel = grpc.aio.insecure_channel(address)
            self._schedulers[address] = (channel, scheduler_pb2_grpc.SchedulerServiceStub(channel))
        return self._schedulers[address][1]

    # ---- streaming --------------------------------------------------------------------------------
    async def _stream(self, record: Tracked,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[admission_pb2.GenerateChunk]:
        detokenizer = Detokenizer(self.model.tokenizer)
        finished = False
        record.followers += 1
        try:
            async for item in record.stream.follow():
                if item.completion is None:
                    text = detokenizer.push(item.tokens)
                    yield convert.chunk(record.request_id, item.index, item.tokens, text, item.emitted_unix_s)
                    continue
                finished = True
                failure = convert.failure_of(item.completion)
                if failure is not None:
                    await context.abort(*failure)
                yield convert.final_chunk(record.request_id, item.index, item.completion, detokenizer.flush())
                return
        finally:
            record.followers -= 1
            if not finished and record.completion is None and record.followers == 0:
                # The last client went away or its deadline passed: stop the work nobody waits for.
                self._spawn(self._cancel_downstream(record, "disconnect"))

    # ---- stream stages (StreamListener): they happen whether or not a client follows ------------
    def first_token(self, stream: RequestStream) -> None:
        """The first token arrived: the request leaves the admission queue; record the stage."""
        record = self.records.get(stream.request_id)
        if record is None or record.timestamps.first_token:
            return
        record.timestamps.first_token = time.time()
        record.status = common_pb2.RUNNING
        self.core.mark_started(record.request_id, time.monotonic())
        record.span.add_event("first_token", timestamp=_ns(record.timestamps.first_token))
        self.metrics.ttft.observe(record.timestamps.first_token - record.received_s)

    def done(self, stream: RequestStream) -> None:
        """Completion and tokens are all here: end the request's span (exactly once)."""
        record = self.records.get(stream.request_id)
        if record is not None and record.completion is not None and not record.ended:
            self.metrics.missing_tokens.inc(stream.missing_tokens)
            self._end_span(record, record.completion)

    async def _cancel_downstream(self, record: Tracked, cause: str) -> common_pb2.RequestStatus:
        """Ask the request's scheduler to cancel it; returns the status it reports."""
        if not record.timestamps.cancel_requested:
            record.timestamps.cancel_requested = time.time()
            record.span.add_event("cancel_requested", attributes={"cause": cause})
            self.metrics.cancellations.labels(cause).inc()
        if not record.scheduler_address:
            return record.status
        metadata = tuple(telemetry.inject_metadata(trace.set_span_in_context(record.span)))
        try:
            response = await self._scheduler(record.scheduler_address).Cancel(
                scheduler_pb2.CancelRequest(request_id=record.request_id), metadata=metadata,
                timeout=DOWNSTREAM_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return record.completion.status if record.completion else record.status
            raise convert.error_from_downstream(exc, "cancel failed at the scheduler") from None
        return response.status

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    # ---- completions --------------------------------------------------------------------------
    async def on_completion(self, entry_id: str, payload: bytes, context: Context) -> None:
        """Handle one completion: release the reservation exactly once, finish the stream and the span.

        Idempotent (the bus delivers at least once); completions of other owners are ignored.
        """
        completion = events_pb2.Completion.FromString(payload)
        if completion.owner and completion.owner != self.owner:
            return
        released = self.core.release(completion.request_id, time.monotonic())
        record = self.records.get(completion.request_id)
        if record is not None and record.completion is None:
            if released is not None:
                self.metrics.active.dec()
            record.completion, record.status = completion, completion.status
        # Last: the stream may be complete now, which ends the span (it reads record.completion).
        self.registry.on_completion(completion)

    def _end_span(self, record: Tracked, completion: events_pb2.Completion) -> None:
        now = time.time()
        record.timestamps.finished = completion.timestamps.finished or now
        status_name = common_pb2.RequestStatus.Name(completion.status)
        span = record.span
        span.set_attribute(telemetry.GEN_AI_USAGE_OUTPUT_TOKENS, completion.usage.output_tokens)
        span.set_attribute(telemetry.GEN_AI_RESPONSE_FINISH_REASONS, [completion.finish_reason])
        span.set_attribute("sluice.status", status_name)
        span.add_event("completed", attributes={"status": status_name, "missing_tokens":
                                                record.stream.missing_tokens})
        if completion.status in convert.FAILURE_STATUS:
            span.set_status(trace.Status(trace.StatusCode.ERROR, status_name))
        span.end()
        record.ended = True
        self.metrics.duration.observe(now - record.received_s)
        outputs = completion.usage.output_tokens
        if record.timestamps.first_token and outputs > 1:
            self.metrics.tpot.observe((now - record.timestamps.first_token) / (outputs - 1))
        self.metrics.requests.labels(record.tenant, status_name.lower()).inc()

    # ---- housekeeping ---------------------------------------------------------------------------
    def expire(self, keep_s: float = 600.0) -> None:
        """Forget streams past the resume window and records finished more than `keep_s` ago."""
        self.registry.expire()
        limit = time.time() - keep_s
        for request_id in [rid for rid, r in self.records.items() if r.completion and r.timestamps.finished < limit]:
            del self.records[request_id]

    async def close(self) -> None:
        """Close downstream channels and wait for background cancels."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for channel, _ in self._schedulers.values():
            await channel.close()
        await self._router_channel.close()
