"""The front door: one generation's way through admission, the same for every transport.

    authenticate -> attach to the request an idempotency key started, or:
    size check -> tokenize -> validate -> hash blocks -> reserve -> route -> TTFT check -> submit
    -> stream (growing the reservation if the output outruns it) -> release (learning the output length)

A transport (the gRPC servicer; an HTTP edge next) converts its message into a `GenerateCall` and
what it knows about the call into a `Caller` (API key, deadline, trace context), awaits
`FrontDoor.start` (every refusal is raised there, before a byte is streamed) and iterates
`FrontDoor.stream`, converting each `Output` back. Closing that iterator before its end is the
cancellation hook: when the last follower of a request goes away, the request is cancelled at its
scheduler. Refusals are the cores' `CoreError`s or `SluiceError`s, and a request that ends without
finishing raises its `RequestEnded` refusal (CANCELLED, TIMED_OUT, FAILED, REJECTED with a retry
delay); the transport maps them once (gRPC: the ErrorInterceptor).

A text prompt over `max_prompt_bytes` is refused untokenized, and a long one is tokenized on a thread
with the GIL released (admission_svc/prompts.py), so one client's long prompt does not hold back other clients' tokens. The
reservation is released exactly once: on the completion, or at once when routing or submitting fails.
With `ttft_slo_s` set, a request the router predicts would wait past the SLO is refused after routing
and before submitting (RESOURCE_EXHAUSTED + RetryInfo of the predicted excess), instead of admitted to wait.
A request whose replica is lost or drained away moves to another (admission_svc/migration.py) and its
stream continues; `complete` is the one way a request ends, whether a completion came or admission ended it.
Other tenants' requests are NOT_FOUND to `cancel` and `lookup`, so no tenant can probe which ids exist.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import Counter

from admission_svc import convert
from admission_svc.calls import Caller, FrontDoorConfig, GenerateCall, Output, OutputSink, Placement, Tracked
from admission_svc.core import AdmissionCore
from admission_svc.front_queue import FrontQueue
from admission_svc.handoff import HandOffs, is_prefill_done, pair_of
from admission_svc.lookups import FROM_LOOKUP, Lookups
from admission_svc.migration import MigrationCause, Migrator, handed_off
from admission_svc.prompts import PromptReader
from admission_svc.ranges import check_wire_ranges
from admission_svc.stops import stop_strings_problem
from admission_svc.streams import RequestStream, StreamRegistry
from sluice import core_errors, errors, telemetry, tls
from sluice.core_errors import CoreError, InvalidRequest, OverBudget
from sluice.hashing import hash_chain, salt_of
from sluice.model_spec import ModelSpec
from sluice.prom import AdmissionMetrics, RequestOutcome
from sluice.safe_text import shown
from sluice.tls import TlsFiles
from sluice.tokenizer import Detokenizer
from sluice.v1 import common_pb2, events_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


_SUCCESS = frozenset({"FINISHED_STOP", "FINISHED_LENGTH"})


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def _gen_ai_attributes(call: GenerateCall, model_id: str, request_id: str, ids: list[int]) -> dict[str, Any]:
    """Return the GenAI request attributes of the root span (prompts are never recorded)."""
    sampling = call.sampling
    attributes: dict[str, Any] = {
        telemetry.GEN_AI_OPERATION_NAME: call.operation, telemetry.GEN_AI_REQUEST_MODEL: model_id,
        telemetry.GEN_AI_RESPONSE_MODEL: model_id, telemetry.GEN_AI_RESPONSE_ID: request_id,
        telemetry.GEN_AI_USAGE_INPUT_TOKENS: len(ids), "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature, "gen_ai.request.top_p": sampling.top_p}
    if sampling.top_k:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    return attributes


class _SinkTap:
    """`FrontDoor.stream`'s tap (admission_svc/streams.py): the Outputs of tokens as they arrive, to a sink."""

    __slots__ = ("request_id", "detokenizer", "sink", "position", "interval", "sent")

    def __init__(self, request_id: str, detokenizer: Detokenizer, sink: OutputSink) -> None:
        self.request_id = request_id
        self.detokenizer = detokenizer
        """The stream's own: its text continues where the yielded Outputs' ended."""
        self.sink = sink
        self.position = 0
        self.interval = 1
        self.sent = False

    def take(self, stream: RequestStream) -> bool:
        if stream.logprobs or not self.sink.ready():
            return False
        index = self.position
        batch = tuple(stream.tokens[index:])
        output = Output(self.request_id, index, batch, self.detokenizer.push(batch), stream.token_emitted[index])
        self.position = index + len(batch)  # the detokenizer has them: never pushed to it twice
        self.sent = True
        self.sink.push(output)
        return True


class FrontDoor:
    """Admission's orchestration around AdmissionCore, the router, the schedulers and the token streams."""

    def __init__(self, core: AdmissionCore, model: ModelSpec, router_address: str, owner: str,
                 metrics: AdmissionMetrics | None = None, config: FrontDoorConfig | None = None,
                 tls_files: TlsFiles | None = None) -> None:
        self.core = core
        self.tls_files = tls_files
        self.model = model
        self.owner = owner
        self.config = config or FrontDoorConfig()
        self.metrics = metrics or AdmissionMetrics()
        self.registry = StreamRegistry(self.config.resume_window_s, listener=self)
        self.records: dict[str, Tracked] = {}
        self._finished: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Finished records' ids, oldest first, with when they finished (monotonic): the ones to forget first."""
        self.evicted = Counter("sluice_admission_records_evicted", "Finished request records forgotten, by bound "
                               "(count: max_finished_records; age: finished_record_ttl_s)", ["reason"],
                               registry=self.metrics.registry)
        self._router_channel = tls.aio_channel(router_address, tls_files)
        self.router = router_pb2_grpc.RouterServiceStub(self._router_channel)
        self._schedulers: dict[str, tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerServiceStub]] = {}
        self._block_size: tuple[float, int] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.prompts = PromptReader(model, self.config, self.metrics)
        self._tracer = telemetry.get_tracer("sluice.admission")
        self.publish_completion: Callable[[events_pb2.Completion], Awaitable[object]] | None = None
        """Publishes on the bus's `completions` (set once the bus is open): a routed request that admission
        refuses or fails to submit gets a REJECTED terminal record there, so the router forgets it."""
        self.metrics.reserved_output_tokens.set_function(lambda: self.core.stats(time.monotonic()).reserved_output_tokens)
        self.metrics.reserved_kv_blocks.set_function(lambda: self.core.stats(time.monotonic()).reserved_kv_blocks)
        self.migrator = Migrator(self)
        self.lookups = Lookups(self)
        self.handoffs = HandOffs(self)
        self.queue = FrontQueue(self.metrics.registry)

    # ---- what transports call -------------------------------------------------------------------
    async def start(self, call: GenerateCall, caller: Caller) -> Tracked:
        """Return the request `call` starts (or the one its idempotency key already started).

        Raises the refusal (bad key, bad input, over budget, no replica) before anything is streamed."""
        received = time.time()
        tenant = self.core.authenticate(caller.api_key)
        fingerprint = hash(call)  # before any field is resolved: what a retry with the key must repeat
        record = self._attach(tenant, call.idempotency_key, fingerprint)
        if record is None:
            ids, tokenized, call = await self._checked_prompt(call)
            blocks = await self._prompt_blocks(call, ids, tenant)
            # Tokenizing on a thread awaits: a retry with the same key may have started the request meanwhile.
            waited = await self._wait_for_room(call, tenant, ids, blocks, caller)
            record = self._attach(tenant, call.idempotency_key, fingerprint)
            if record is None:
                record = await self._admit(call, tenant, (ids, blocks), caller, (received, tokenized), fingerprint)
                if waited:
                    record.span.add_event("front_door_queued", attributes={"sluice.queued_s": waited})
                self.metrics.requests.labels(tenant, "admitted").inc()
                return record
        self.metrics.requests.labels(tenant, "attached").inc()
        return record

    async def stream(self, record: Tracked, sink: OutputSink | None = None,
                     interval: int = 1) -> AsyncGenerator[Output, None]:
        """Yield the request's tokens with their text, then a last Output carrying the completion.

        Raises the request's RequestEnded refusal when it ends without finishing. Closing the iterator
        early (the client went away) cancels the request once nobody else follows it.

        `sink`: while the caller waits for the next Output, tokens that arrive go to `sink.push` instead
        whenever `sink.ready()` (as the Outputs this would yield: the same text, in order; never tokens with
        log-probabilities), and are not yielded.

        `interval`: the caller's stream interval (vLLM's per-request `stream_interval`); the larger of it and the
        process's --stream-interval holds tokens after the first (`RequestStream.follow`)."""
        detokenizer = Detokenizer(self.model.tokenizer)
        finished = False
        record.followers += 1
        tap = _SinkTap(record.request_id, detokenizer, sink) if sink is not None else None
        try:
            async for item in record.stream.follow(tap=tap, interval=max(interval, self.config.stream_interval)):
                if item.completion is None:
                    logprobs = record.stream.logprobs
                    yield Output(record.request_id, item.index, item.tokens, detokenizer.push(item.tokens),
                                 item.emitted_unix_s, None, tuple(logprobs[i] for i in range(
                                     item.index, item.index + len(item.tokens)) if i in logprobs) if logprobs else ())
                    continue
                finished = True
                failure = self._ended(record, item.completion)
                if failure is not None:
                    raise failure
                yield Output(record.request_id, item.index, text=detokenizer.flush(), completion=item.completion)
                return
        finally:
            record.followers -= 1
            if not finished and record.completion is None and record.followers == 0:
                # The last client went away or its deadline passed: stop the work nobody waits for.
                self.spawn(self.cancel_downstream(record, "disconnect"))

    def lookup(self, request_id: str, api_key: str | None) -> Tracked:
        """Return one of the caller's requests; raises NotFound for unknown and other tenants' ids alike."""
        tenant = self.core.authenticate(api_key)
        record = self.records.get(request_id)
        if record is None or record.tenant != tenant:
            raise errors.NotFound(f"request {shown(request_id)} not found", reason="unknown_request")
        return record

    async def cancel(self, request_id: str, api_key: str | None) -> common_pb2.RequestStatus:
        """Cancel one of the caller's requests; returns its status (terminal ones are left as they are)."""
        record = self.lookup(request_id, api_key)
        if record.completion is not None:
            return record.completion.status
        return await self.cancel_downstream(record, "client")

    # ---- admission --------------------------------------------------------------------------------
    def _attach(self, tenant: str, key: str, fingerprint: int) -> Tracked | None:
        """Return the request `key` started, or None; raises DuplicateRequest when it started another request."""
        if not key:
            return None
        try:
            request_id = self.core.lookup_key(tenant, key, time.monotonic(), fingerprint)
        except CoreError as exc:
            self.metrics.rejections.labels(exc.reason_word).inc()
            raise
        return self.records.get(request_id) if request_id else None

    async def _checked_prompt(self, call: GenerateCall) -> tuple[list[int], float | None, GenerateCall]:
        """Return the prompt's ids, when its text was tokenized (None: it came as ids) and the call with an unset
        max_tokens resolved (the rest of the model length); raises the refusal."""
        if not self.model.accepts(call.model):
            self.metrics.rejections.labels("unknown_model").inc()
            raise errors.NotFound(f"unknown model {shown(call.model)}; this deployment serves "
                                  f"{self.model.model_id!r}", reason="unknown_model", field_name="model")
        try:
            check_wire_ranges(call.sampling, call.priority)  # before any tokenizing
            if (problem := stop_strings_problem(call.sampling.stop_strings)) is not None:
                raise InvalidRequest("sampling.stop_strings", problem)
            ids = await self.prompts.ids(call)
            if call.max_tokens_unset:  # vLLM's chat default: whatever the model length leaves after the prompt
                call = dataclasses.replace(call, sampling=dataclasses.replace(
                    call.sampling, max_tokens=self.model.max_model_len - len(ids)), max_tokens_unset=False)
            sampling = call.sampling
            self.core.validate(len(ids), sampling.max_tokens, temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k)
            self.core.validate_penalties(sampling, self.model.vocab_size)
        except CoreError as exc:
            self.metrics.rejections.labels(exc.reason_word).inc()
            raise
        return ids, (time.time() if not call.prompt_token_ids else None), call

    async def _prompt_blocks(self, call: GenerateCall, ids: list[int], tenant: str) -> tuple[list[int], int]:
        """Return the prompt's block-hash chain (for the router and the KV-block budget) and the block size.

        The chain is salted with the tenant's cache salt, as the scheduler will name its blocks."""
        block_size = await self._block_size_now()
        salt = salt_of(self.model.model_id, call.adapter_version, self.core.cache_salt(tenant))
        return hash_chain(ids, block_size, salt), block_size

    async def _wait_for_room(self, call: GenerateCall, tenant: str, ids: list[int], blocks: tuple[list[int], int],
                             caller: Caller) -> float:
        """Wait in the tenant's line at the front door while the request finds no room in its budgets (only when
        the config sets max_queued_requests); return the seconds waited. Admission itself then admits the
        request or refuses it (RESOURCE_EXHAUSTED: the line was full or the wait timed out)."""
        limit, timeout_s = self.core.queue_limits(tenant)
        if not limit:
            return 0.0
        if caller.deadline_unix_s is not None:
            timeout_s = min(timeout_s, caller.deadline_unix_s - time.time())
        hashes, model_id = tuple(blocks[0]), self.model.model_id

        def fits() -> bool:
            return self.core.fits(tenant, len(ids), call.sampling.max_tokens, time.monotonic(), model=model_id,
                                  block_hashes=hashes, block_size=blocks[1])

        return await self.queue.wait(tenant, fits, limit, timeout_s)

    async def _admit(self, call: GenerateCall, tenant: str, prompt: tuple[list[int], tuple[list[int], int]],
                     caller: Caller, stamps: tuple[float, float | None], fingerprint: int = 0) -> Tracked:
        """Reserve, route and submit; undo the reservation if routing, the TTFT check or submitting fails.

        `prompt`: the token ids, and the block hashes with the block size; `fingerprint`: the call's, for its key."""
        ids, blocks = prompt
        record = self._reserve(call, tenant, ids, blocks, stamps, caller.trace_context, fingerprint)
        record.span.set_attributes(dict(caller.span_attributes))
        try:
            await self.route_and_submit(record, call, ids, caller.deadline_unix_s, blocks[0])
            record.placement = Placement(call, tuple(ids), caller.deadline_unix_s)
        except BaseException as exc:
            error = convert.error_from_downstream(exc, "could not place the request") \
                if isinstance(exc, grpc.aio.AioRpcError) else exc
            self._abandon(record, error)
            if error is not exc:
                raise error from None
            raise
        return record

    def _reserve(self, call: GenerateCall, tenant: str, ids: list[int], blocks: tuple[list[int], int],
                 stamps: tuple[float, float | None], parent: Context | None, fingerprint: int = 0) -> Tracked:
        """Admit (no await between the key lookup and here, so two retries cannot both start).

        `stamps`: when the call was received, and when its text was tokenized (None: it came as ids)."""
        (received, tokenized), request_id = stamps, uuid.uuid4().hex
        # GenAI conventions: the span is named "{gen_ai.operation.name} {gen_ai.request.model}".
        span = self._tracer.start_span(f"{call.operation} {self.model.model_id}", context=parent,
                                       kind=trace.SpanKind.SERVER, start_time=_ns(received),
                                       attributes=_gen_ai_attributes(call, self.model.model_id, request_id, ids))
        span.set_attributes({"sluice.request_id": request_id, "sluice.tenant": tenant,
                             "sluice.priority": call.priority})
        span.add_event("received", timestamp=_ns(received))
        if tokenized is not None:
            span.add_event("tokenized", timestamp=_ns(tokenized))
        try:
            reservation = self.core.admit(request_id, tenant, len(ids), call.sampling.max_tokens, time.monotonic(),
                                          model=self.model.model_id, block_hashes=tuple(blocks[0]),
                                          block_size=blocks[1])
        except OverBudget as exc:
            self.metrics.rejections.labels(exc.budget).inc()
            span.add_event("rejected", attributes={"reason": exc.budget})
            telemetry.end_request_span(span, "REJECTED", exc.detail)
            raise
        now = time.time()
        span.add_event("admitted", timestamp=_ns(now), attributes={
            "sluice.reserved_output_tokens": reservation.reserved_output_tokens})
        if call.idempotency_key:
            self.core.remember_key(tenant, call.idempotency_key, request_id, time.monotonic(), fingerprint)
        record = Tracked(request_id, tenant, len(ids), self.registry.open(request_id), span, received,
                         operation=call.operation, idempotency_key=call.idempotency_key)
        record.timestamps.received, record.timestamps.admitted = received, now
        record.attempt_id = request_id
        self.records[request_id] = record
        self.metrics.active.inc()
        return record

    async def _block_size_now(self) -> int:
        """Return the replicas' block size: asked of the router once, then refreshed in the background every 5 s
        (a request does not wait for that extra round trip)."""
        cached = self._block_size
        if cached is not None:
            if time.monotonic() - cached[0] >= 5.0:
                self._block_size = (time.monotonic(), cached[1])  # one refresh at a time
                self.spawn(self._fetch_block_size())
            return cached[1]
        return await self._fetch_block_size()

    async def _fetch_block_size(self) -> int:
        size = self.config.default_block_size
        with contextlib.suppress(grpc.aio.AioRpcError):
            listed = await self.router.ListReplicas(router_pb2.ListReplicasRequest(),
                                                    timeout=self.config.downstream_timeout_s)
            sizes = [r.block_size for r in listed.replicas if r.block_size > 0 and self.model.accepts(r.model)]
            size = sizes[0] if sizes else size
        self._block_size = (time.monotonic(), size)
        return size

    async def route_and_submit(self, record: Tracked, call: GenerateCall, ids: list[int],
                               deadline_unix_s: float | None, hashes: list[int] | None = None) -> None:
        """Route the record's current attempt and submit it there. Raises grpc.aio.AioRpcError.

        `hashes`: the prompt's block chain, computed at admission (a first attempt, which the TTFT check
        applies to); None for a migrated attempt, whose prompt (with the tokens already streamed) is
        hashed here and which is never refused: it was admitted already. A Submit that cannot reach its
        scheduler is routed again as a new attempt (Migrator.reroute), within the migration limit."""
        first_attempt = hashes is not None
        if hashes is None:
            hashes, _ = await self._prompt_blocks(call, ids, record.tenant)
        metadata = tuple(telemetry.inject_metadata(trace.set_span_in_context(record.span)))
        while True:
            route = await self._route(record, call, ids, hashes, metadata)
            if first_attempt:
                self._check_ttft(record, route.predicted_ttft_s)
            submit = convert.submit_request(record.attempt_id, record.tenant, ids, call, self.owner,
                                            deadline_unix_s or 0.0, self.model, record.timestamps,
                                            self.core.tenant_weight(record.tenant), self.core.cache_salt(record.tenant),
                                            self.config.stream_interval)
            submit.owner_incarnation = self.migrator.incarnation  # the request lives while our lease does
            record.handoff = pair_of(record, route, call.sampling.max_tokens)
            if record.handoff is not None:  # the prefill half of a pair (admission_svc/handoff.py)
                submit.sampling.max_tokens = 1
                submit.hold_kv = True
            sent = record.submit_sent_s = time.time()
            try:
                await self.scheduler(route.scheduler_address).Submit(submit, metadata=metadata,
                                                                     timeout=self.config.downstream_timeout_s)
            except grpc.aio.AioRpcError as exc:
                # An unreachable scheduler (dead, before the router noticed): route again, elsewhere.
                if await self.migrator.reroute(record, exc):
                    continue
                raise
            break
        self._submitted(record, sent)

    def _submitted(self, record: Tracked, sent: float) -> None:
        """Record the stage of a Submit the scheduler accepted. Its first token can arrive over Redis before the
        Submit's reply (the scheduler runs it at once, or even finishes it): the span then gets `submitted`
        (stamped when it was sent) before `first_token`, and the status is left as the stream set it (setting it
        to WAITING here turned RUNNING and finished requests back into waiting ones)."""
        first, record.submitted = not record.submitted, True
        if record.ended:  # it finished before the reply came: `_end_span` recorded both stages
            return
        record.span.add_event("submitted", timestamp=_ns(sent))
        if first and record.timestamps.first_token:
            record.span.add_event("first_token", timestamp=_ns(record.timestamps.first_token))

    async def _route(self, record: Tracked, call: GenerateCall, ids: list[int], hashes: list[int],
                     metadata: tuple[tuple[str, str], ...]) -> router_pb2.RouteResponse:
        """Ask the router for the record's current attempt; record where it goes. Raises grpc.aio.AioRpcError."""
        route = await self.router.Route(router_pb2.RouteRequest(
            request_id=record.attempt_id, model=self.model.model_id, adapter_version=call.adapter_version,
            block_hashes=hashes, prompt_tokens=len(ids), max_tokens=call.sampling.max_tokens, tenant=record.tenant),
            metadata=metadata, timeout=self.config.downstream_timeout_s)
        record.timestamps.routed = time.time()
        record.replica_id, record.scheduler_address = route.replica_id, route.scheduler_address
        record.incarnation = route.incarnation
        record.span.add_event("routed", timestamp=_ns(record.timestamps.routed), attributes={
            "sluice.replica_id": route.replica_id, "sluice.cached_blocks": route.cached_blocks,
            "sluice.predicted_ttft_s": route.predicted_ttft_s, "sluice.decode_replica_id": route.decode_replica_id})
        return route

    def _check_ttft(self, record: Tracked, predicted_ttft_s: float) -> None:
        """Refuse early (the core decides) a routed request that would wait past the TTFT SLO."""
        self.metrics.predicted_ttft.observe(predicted_ttft_s)
        try:
            self.core.check_ttft(record.request_id, predicted_ttft_s, time.monotonic())
        except OverBudget as exc:
            self.metrics.rejections.labels(exc.budget).inc()
            record.span.add_event("refused_early", attributes={"sluice.predicted_ttft_s": predicted_ttft_s,
                                                               "sluice.retry_after_s": exc.retry_after_s or 0.0})
            raise

    def _abandon(self, record: Tracked, exc: BaseException) -> None:
        """Undo an admission whose routing or submission failed: release, forget, end the span."""
        if self.core.release(record.request_id, time.monotonic()) is not None:  # not when a completion came first
            self.metrics.active.dec()
        self.queue.released()
        self.records.pop(record.request_id, None)
        record.status = common_pb2.REJECTED
        record.retry_after_s = getattr(exc, "retry_after_s", None)
        # An idempotent retry may already follow this request: end its stream too.
        completion = events_pb2.Completion(
            request_id=record.request_id, tenant=record.tenant, status=common_pb2.REJECTED, finish_reason="rejected",
            detail=str(exc)[:200], owner=self.owner, replica_id=record.replica_id)
        record.stream.set_completion(completion)
        if record.replica_id:
            self.migrator.forget_attempt(record, record.attempt_id or record.request_id, record.replica_id,
                                         str(exc)[:200])
        record.stream.complete_if_ready()
        record.span.add_event("rejected", attributes={"reason": type(exc).__name__})
        telemetry.end_request_span(record.span, "REJECTED", str(exc)[:200])
        record.ended = True

    def _ended(self, record: Tracked, completion: events_pb2.Completion) -> CoreError | None:
        """Return the refusal a completion ends the stream with (None for a finished request)."""
        status = common_pb2.RequestStatus.Name(completion.status)
        detail = f": {completion.detail}" if completion.detail else ""
        outputs = completion.usage.output_tokens
        return core_errors.ended_error(status, f"request {record.request_id} {status} after {outputs} output tokens"
                                               f"{detail}", record.retry_after_s, lost=record.lost)

    def scheduler(self, address: str) -> scheduler_pb2_grpc.SchedulerServiceStub:
        """Return the stub of the scheduler at `address` (one channel per address)."""
        self.scheduler_channel(address)
        return self._schedulers[address][1]

    def forget_scheduler(self, address: str) -> None:
        """Drop the channel to a scheduler that could not be reached: the next call dials it afresh, instead of
        failing at once while the old channel backs off from a restart (grpc's reconnect backoff)."""
        entry = self._schedulers.pop(address, None)
        if entry is not None:
            self.spawn(entry[0].close(grace=1.0))

    def scheduler_channel(self, address: str) -> grpc.aio.Channel:
        """Return the channel to the scheduler at `address`, opening it once."""
        if address not in self._schedulers:
            # Its own connection (not grpc's shared subchannel): a channel opened after `forget_scheduler`
            # dials at once instead of inheriting the old one's reconnect backoff.
            channel = tls.aio_channel(address, self.tls_files, (("grpc.use_local_subchannel_pool", 1),))
            self._schedulers[address] = (channel, scheduler_pb2_grpc.SchedulerServiceStub(channel))
        return self._schedulers[address][0]

    # ---- stream stages (StreamListener): they happen whether or not a client follows ------------
    def first_token(self, stream: RequestStream) -> None:
        """The first token arrived: the request leaves the admission queue; record the stage."""
        record = self.records.get(stream.request_id)
        if record is None or record.timestamps.first_token:
            return
        record.timestamps.first_token = time.time()
        record.status = common_pb2.RUNNING
        self.core.mark_started(record.request_id, time.monotonic())
        self.queue.released()  # its prompt is no longer pending nor queued: room for a waiting request
        if record.submitted:  # else `_submitted` adds it, after the stage it follows
            record.span.add_event("first_token", timestamp=_ns(record.timestamps.first_token))
        self.metrics.ttft.observe(record.timestamps.first_token - record.received_s)

    def progress(self, stream: RequestStream) -> None:
        """More tokens arrived: grow the reservation if the request outran it (the core's rule applies)."""
        growth = self.core.on_tokens(stream.request_id, len(stream.tokens), time.monotonic())
        if growth is None:
            return
        self.metrics.reservation_growths.labels("overcommitted" if growth.overcommitted else "granted").inc()
        record = self.records.get(stream.request_id)
        if record is not None and not record.ended:
            record.span.add_event("reservation_grown", attributes={
                "sluice.reserved_output_tokens": growth.reserved_output_tokens,
                "sluice.overcommitted": growth.overcommitted})

    def done(self, stream: RequestStream) -> None:
        """Completion and tokens are all here: end the request's span (exactly once)."""
        record = self.records.get(stream.request_id)
        if record is not None and record.completion is not None and not record.ended:
            self.metrics.missing_tokens.inc(stream.missing_tokens)
            self._end_span(record, record.completion)

    async def cancel_downstream(self, record: Tracked, cause: str) -> common_pb2.RequestStatus:
        """Ask the request's scheduler to cancel it; returns the status it reports."""
        if record.ended or record.completion is not None:
            # It ended while this cancel waited to run (a spawned one: the last follower left as the completion
            # landed): nothing to cancel, and its span has ended.
            return record.completion.status if record.completion is not None else record.status
        if not record.timestamps.cancel_requested:
            record.timestamps.cancel_requested = time.time()
            record.span.add_event("cancel_requested", attributes={"cause": cause})
            self.metrics.cancellations.labels(cause).inc()
        if not record.scheduler_address:
            return record.status
        metadata = tuple(telemetry.inject_metadata(trace.set_span_in_context(record.span)))
        try:
            response = await self.scheduler(record.scheduler_address).Cancel(
                scheduler_pb2.CancelRequest(request_id=record.attempt_id or record.request_id), metadata=metadata,
                timeout=self.config.downstream_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                if record.completion is None:  # the scheduler forgot it: end it here unless a completion comes
                    self.spawn(self.migrator.end_unknown(record, record.attempt_id, cause))
                return record.completion.status if record.completion else record.status
            raise convert.error_from_downstream(exc, "cancel failed at the scheduler") from None
        return response.status

    def spawn(self, coroutine: Any) -> None:
        """Run `coroutine` in the background (close waits for it; a failure is logged)."""
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

        Idempotent (the bus delivers at least once); completions of other owners are ignored. `entry_id` is the
        bus entry's, or FROM_LOOKUP for one the watchdog fetched from its scheduler (admission_svc/lookups.py).
        """
        completion = events_pb2.Completion.FromString(payload)
        if completion.owner and completion.owner != self.owner:
            return
        request_id = self.migrator.attempts.get(completion.request_id, completion.request_id)
        record = self.records.get(request_id)
        if entry_id != FROM_LOOKUP:  # first: a copy of an attempt the request has moved away from counts too
            self.lookups.on_bus_copy(completion, record)
        if record is not None:
            if record.attempt_id and completion.request_id != record.attempt_id:
                return  # an attempt the request has moved away from
            if record.completion is None and handed_off(record, completion):
                self.spawn(self.migrator.migrate(record, MigrationCause.HANDED_OFF))
                return
            if is_prefill_done(record, completion):  # its decode half follows, on the pair's decode replica
                self.spawn(self.handoffs.hand_off(record, completion))
                return
            completion = self.migrator.whole(record, completion)
            if self.migrator.held(record, completion):
                return  # its last tokens are still on the way (or lost: then it moves)
        self.complete(request_id, record, completion)

    def complete(self, request_id: str, record: Tracked | None, completion: events_pb2.Completion) -> None:
        """End a request: release its reservation (exactly once), record and deliver its completion."""
        finished = completion.status in (common_pb2.FINISHED_STOP, common_pb2.FINISHED_LENGTH)
        outputs = completion.usage.output_tokens if finished else None
        released = self.core.release(request_id, time.monotonic(), outputs)
        self.queue.released()
        if released is not None and outputs is not None:
            self.metrics.reclaimed_output_tokens.inc(max(released.reserved_output_tokens - outputs, 0))
        if record is not None and record.completion is None:
            if released is not None:
                self.metrics.active.dec()
            record.completion, record.status = completion, completion.status
            self._remember_finished(request_id)
        # Last: the stream may be complete now, which ends the span (it reads record.completion).
        self.registry.on_completion(completion)
        self.publish_budgets()

    def publish_budgets(self) -> None:
        """Set the budget gauges from the core's ledger (what is reserved now)."""
        stats = self.core.stats(time.monotonic())
        for budget in ("active", "queued", "pending_input_tokens", "reserved_output_tokens"):
            self.metrics.budget_in_use.labels(budget).set(getattr(stats, budget))

    def _end_span(self, record: Tracked, completion: events_pb2.Completion) -> None:
        now = time.time()
        record.timestamps.finished = completion.timestamps.finished or now
        status_name = common_pb2.RequestStatus.Name(completion.status)
        span = record.span
        if not record.submitted and record.timestamps.first_token and record.submit_sent_s:
            # Tokens came, so the scheduler took the Submit whose reply is still on the way: its stages go in first.
            record.submitted = True
            span.add_event("submitted", timestamp=_ns(record.submit_sent_s))
            span.add_event("first_token", timestamp=_ns(record.timestamps.first_token))
        span.set_attribute(telemetry.GEN_AI_USAGE_OUTPUT_TOKENS, completion.usage.output_tokens)
        span.set_attribute(telemetry.GEN_AI_RESPONSE_FINISH_REASONS, [completion.finish_reason])
        span.add_event("completed", attributes={"status": status_name, "missing_tokens":
                                                record.stream.missing_tokens})
        telemetry.end_request_span(span, status_name, completion.detail)
        record.ended = True
        self.metrics.duration.observe(now - record.received_s)
        outputs = completion.usage.output_tokens
        first_token = record.timestamps.first_token
        tpot = (now - first_token) / (outputs - 1) if first_token and outputs > 1 else None
        if tpot is not None:
            self.metrics.tpot.observe(tpot)
        self.metrics.requests.labels(record.tenant, status_name.lower()).inc()
        self.metrics.gen_ai_request(record.operation, self.model.model_id, RequestOutcome(
            duration_s=now - record.received_s, ttft_s=first_token - record.received_s if first_token else None,
            tpot_s=tpot, input_tokens=record.input_tokens, output_tokens=outputs,
            error_type="" if status_name in _SUCCESS else status_name))

    # ---- housekeeping ---------------------------------------------------------------------------
    def _remember_finished(self, request_id: str) -> None:
        """Keep a finished record, forgetting the oldest ones beyond max_finished_records (memory stays bounded
        whatever the request rate)."""
        self._finished[request_id] = time.monotonic()
        while len(self._finished) > self.config.max_finished_records:
            self._forget(self._finished.popitem(last=False)[0], "count")

    def _forget(self, request_id: str, reason: str) -> None:
        record = self.records.pop(request_id, None)
        self.registry.forget(request_id)
        if record is not None and record.idempotency_key:
            self.core.forget_key(record.tenant, record.idempotency_key, request_id)
        self.evicted.labels(reason).inc()

    def expire(self) -> None:
        """Forget streams past the resume window and records finished more than finished_record_ttl_s ago."""
        self.registry.expire()
        limit = time.monotonic() - self.config.finished_record_ttl_s
        while self._finished:
            request_id, finished_at = next(iter(self._finished.items()))
            if finished_at >= limit:
                break
            del self._finished[request_id]
            self._forget(request_id, "age")
        attempts = self.migrator.attempts
        for attempt in [a for a, rid in attempts.items() if rid not in self.records]:
            del attempts[attempt]

    async def close(self) -> None:
        """Close downstream channels, wait for background cancels, stop the tokenizer threads."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        for channel, _ in self._schedulers.values():
            await channel.close()
        await self._router_channel.close()
        self.prompts.close()

