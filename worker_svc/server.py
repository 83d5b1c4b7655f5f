"""The worker's gRPC service: Execute (unary), ExecuteStream (a stream of rounds), Info, and gRPC health.

Theory of operation
- `WorkerRuntime` owns the backend. Loading (weights) and every round run in one dedicated thread,
  so the event loop stays free for RPCs and health checks, and rounds never overlap on the device.
- Health is NOT_SERVING until the backend is loaded and one warm-up round has run, then SERVING;
  Execute and Info answer UNAVAILABLE until then.
- A sequence that does not fit the worker (positions past the model length, token or block ids out of
  range, bad sampling parameters: `validation._check_seq`) is refused before the round runs: it is taken
  out, the rest of the round runs, and the result names it in `refused` (field and INVALID_ARGUMENT
  message; the scheduler fails exactly that request), on Execute and ExecuteStream alike. Each refusal is
  logged, counted (`sluice_worker_refused_sequences_total{field}`) and, in a traced round, a `seq_refused`
  event of its span.
- A plan that does not fit as a whole (swaps out of range, a request twice, more tokens than KV slots)
  is refused before it runs: Execute answers INVALID_ARGUMENT; on ExecuteStream the round's result carries
  `error` ("INVALID_ARGUMENT ...": the scheduler fails that round's requests) and the stream goes on, so
  one bad plan never reads as a lost worker.
- A pipelined round queued behind a refused round (or sequence) drops its pending decodes of the refused
  requests: nothing was sampled for them, and the scheduler has failed them.
- A backend exception fails the round as a whole: the result carries `error` (the scheduler fails the
  round's requests); the service keeps serving.
- The round link (worker_svc/round_link.py, on a port of its own that Info advertises) carries the same stream of
  rounds as protobuf frames on a plain stream: the scheduler's default, cheaper per round than gRPC. Both are
  served by `WorkerServicer.rounds`, so everything said of ExecuteStream here holds for it.
- ExecuteStream converts and validates each plan as it arrives and queues it on the backend thread at
  once (`WorkerRuntime.queue`): the thread starts a queued round the moment the one before ends, without
  a hop through the event loop, so rounds queued by the pipelined scheduler run back to back; results are
  written in order. Rounds of a closed stream that have not started are cancelled.
- Rounds placed ahead (the scheduler plans round N+1 while N executes): a sequence whose token is
  `PENDING_TOKEN` decodes the token this worker sampled for the same request and epoch in the round
  before; the runtime fills it in from the previous round's outputs before the backend sees the plan.
- `sluice_worker_idle_seconds`: the gap between one round's end and the next one's start, both in the
  backend thread (the device waiting for the control plane; with a round queued, only the thread's own
  pending-token fill-in).
- `emulate_time`: a backend whose `elapsed_s` is modelled (the cost model) is made to take that long
  (times `time_scale`: a slower or faster device), so that load tests on a CPU see GPU-like round times.
- Tracing: a round that carries trace contexts (`RoundPlan.traces`: the sampled requests it serves, as
  many as the scheduler sends) gets a `worker.round` span, a root of its own trace with one link per
  request; a round that carries none costs no span.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace

from sluice import convert, services, telemetry, tls
from sluice.errors import ErrorInterceptor, FailedPrecondition, InvalidArgument, Unavailable
from sluice.prom import WorkerMetrics
from sluice.serve import grpc_server
from sluice.tls import TlsFiles
from sluice.types import (
    RefusedSeq,
    RoundPlan,
    RoundResult,
    SeqOutput,
)
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.backend import Backend, BackendInfo
from worker_svc.engine.errors import PlanError
from worker_svc.round_link import RoundLinkServer
from worker_svc.rounds import PENDING, field_kind, filled, wait_until, warmup_plan
from worker_svc.validation import validate_plan

__all__ = ["SERVICE_NAME", "WorkerRuntime", "WorkerServicer", "start_worker_server"]

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer("sluice.worker")

SERVICE_NAME = services.WORKER


class WorkerRuntime:
    """Loads a backend off the event loop, warms it up, and runs its rounds one at a time in one thread."""

    def __init__(self, load: Callable[[], Backend], *, num_blocks: int | None = None,
                 emulate_time: bool = False, time_scale: float = 1.0, metrics: WorkerMetrics | None = None) -> None:
        if not 0 < time_scale < math.inf:
            raise ValueError(f"time_scale {time_scale}: must be a finite number > 0")
        self._load = load
        self._num_blocks = num_blocks
        self._emulate_time = emulate_time
        self._time_scale = time_scale
        """With emulate_time, a round takes this multiple of its modelled time."""
        self.metrics = metrics or WorkerMetrics()
        self.incarnation = uuid.uuid4().hex[:16]
        """New on every start: the epoch of this worker's KV cache (WorkerInfo.incarnation). A ReadKv for blocks
        named under another incarnation is refused: a restarted worker's blocks do not hold them."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-backend")
        self._backend: Backend | None = None
        self._info: BackendInfo | None = None
        self._lock = asyncio.Lock()
        self.ready = asyncio.Event()
        self._last_outputs: tuple[SeqOutput, ...] = ()
        """The last round's outputs: what its pending tokens stand for (indexed only when a plan has one)."""
        self._last_end: float | None = None
        """When the backend thread finished the last round (the device's idle time starts there)."""
        self._refused: frozenset[str] = frozenset()
        """Requests the last round refused (all of its requests when it was refused as a whole): the next round's
        pending decodes of them are dropped."""

    async def start(self) -> BackendInfo:
        """Load the backend and run a warm-up round; return its info. Raises what loading or warm-up raises."""
        loop = asyncio.get_running_loop()
        backend = await loop.run_in_executor(self._executor, self._load)
        info = backend.info()
        if self._num_blocks is not None:
            if self._num_blocks > info.num_blocks:
                raise ValueError(f"--num-blocks {self._num_blocks} exceeds the backend's capacity of "
                                 f"{info.num_blocks} blocks")
            info = dataclasses.replace(info, num_blocks=self._num_blocks)
        self._backend, self._info = backend, info
        warm = await self._run(warmup_plan(info))
        if warm.error:
            raise RuntimeError(f"warm-up round failed: {warm.error}")
        self.metrics.serving.set(1)
        self.ready.set()
        log.info("worker ready: %s", info)
        return info

    def info(self) -> BackendInfo:
        """Return the backend's info. Raises Unavailable until the backend is loaded."""
        if self._info is None:
            raise Unavailable("the worker is still loading its model", reason="WORKER_LOADING")
        return self._info

    async def execute(self, plan: RoundPlan, rpc: str = "Execute") -> RoundResult:
        """Run one round and return its result (`error` set when the backend raised; `refused`: the sequences
        that did not fit and did not run).

        Raises Unavailable until the warm-up round has run, InvalidArgument for a plan that does not
        fit this worker as a whole (worker_svc/validation.py), before it takes the device.
        """
        plan, refused = self.validate(plan)
        self.metrics.rounds.labels(rpc).inc()
        return await self._run(plan, refused)

    def validate(self, plan: RoundPlan) -> tuple[RoundPlan, tuple[RefusedSeq, ...]]:
        """Return the part of `plan` that runs and the sequences refused from it (each logged and counted).

        Raises Unavailable until the warm-up round has run, InvalidArgument for a plan that does not fit as a
        whole."""
        if not self.ready.is_set() or self._info is None:
            raise Unavailable("the worker is not ready (loading or warming up)", reason="WORKER_LOADING")
        refused = validate_plan(plan, self._info)
        if not refused:
            return plan, ()
        for seq in refused:
            log.warning("round %d: refused the sequence of request %r: %s", plan.round_id, seq.request_id[:64],
                        seq.detail)
            self.metrics.refused_seqs.labels(field_kind(seq.field_name)).inc()
        ids = {seq.request_id for seq in refused}
        return dataclasses.replace(plan, seqs=tuple(s for s in plan.seqs if s.request_id not in ids)), refused

    def queue(self, plan: RoundPlan, refused: tuple[RefusedSeq, ...] = (),
              rpc: str = "ExecuteStream") -> asyncio.Future[RoundResult]:
        """Queue a validated plan (what `validate` returned) on the backend thread at once, behind any round
        queued before it; return the future of its result (an exception the backend raised is the future's).
        The thread starts it the moment the round before ends, with no hop through the event loop: the
        device's idle gap is the thread's own."""
        self.metrics.rounds.labels(rpc).inc()
        assert self._backend is not None
        return asyncio.get_running_loop().run_in_executor(self._executor, self._execute, self._backend, plan,
                                                          refused)

    def queue_refusal(self, plan: RoundPlan, exc: InvalidArgument) -> RoundResult:
        """Answer a plan refused as a whole with a failed round (the scheduler fails its requests) instead of ending
        the stream. In order on the backend thread (rounds queued before it still read the outputs they need), the
        next round's pending decodes of its requests are marked to be dropped (nothing was sampled for them)."""
        self._executor.submit(self._refused_round, plan)
        return self._refusal(plan, exc)

    async def finished(self, plan: RoundPlan, future: asyncio.Future[RoundResult]) -> RoundResult:
        """Await a queued round and account for it like `execute` (a backend exception fails the round)."""
        try:
            result = await future
        except Exception as exc:
            log.exception("round %d failed", plan.round_id)
            self.metrics.round_errors.inc()
            return RoundResult(plan.round_id, (), 0.0, error=f"{type(exc).__name__}: {exc}")
        self.metrics.execute_duration.observe(result.elapsed_s)
        self._count_tokens(plan)
        return result

    def _refused_round(self, plan: RoundPlan) -> None:
        self._refused = frozenset(seq.request_id for seq in plan.seqs)
        self._last_outputs = ()

    def _refusal(self, plan: RoundPlan, exc: InvalidArgument) -> RoundResult:
        log.warning("round %d refused: %s (%s)", plan.round_id, exc, exc.field_name)
        self.metrics.round_errors.inc()
        field = f" ({exc.field_name})" if exc.field_name else ""
        return RoundResult(plan.round_id, (), 0.0, error=f"INVALID_ARGUMENT{field}: {exc}")

    async def _run(self, plan: RoundPlan, refused: tuple[RefusedSeq, ...] = ()) -> RoundResult:
        backend = self._backend
        assert backend is not None
        loop = asyncio.get_running_loop()
        async with self._lock:  # one device: rounds run strictly one after another
            start = time.perf_counter()
            try:
                result = await loop.run_in_executor(self._executor, self._execute, backend, plan, refused)
            except Exception as exc:
                log.exception("round %d failed", plan.round_id)
                self.metrics.round_errors.inc()
                return RoundResult(plan.round_id, (), time.perf_counter() - start,
                                   error=f"{type(exc).__name__}: {exc}")
        self.metrics.execute_duration.observe(result.elapsed_s)
        self._count_tokens(plan)
        return result

    def _execute(self, backend: Backend, plan: RoundPlan, refused: tuple[RefusedSeq, ...] = ()) -> RoundResult:
        """Fill in pending tokens from the previous round's samples, run the round (without its `refused`
        sequences, which `validate` took out), remember its samples and what it refused. Runs in the backend
        thread. Raises LookupError for a pending token the last round did not sample."""
        if self._last_end is not None:
            self.metrics.idle.observe(time.perf_counter() - self._last_end)
        pending, dropped = PENDING, self._refused
        self._refused = frozenset([seq.request_id for seq in refused]) if refused else frozenset()
        if any(seq.token_ids == pending for seq in plan.seqs):
            sampled = {out.request_id: out for out in self._last_outputs}
            plan = dataclasses.replace(plan, seqs=tuple(filled(seq, sampled) if seq.token_ids == pending else seq
                                                        for seq in plan.seqs
                                                        if seq.token_ids != pending or seq.request_id not in dropped))
        if (refused or dropped) and plan.is_empty:  # every sequence was refused or a pending decode of one
            self._last_outputs = ()
            return RoundResult(plan.round_id, (), refused=refused)
        start = time.perf_counter()
        try:
            result = backend.execute(plan)
            if self._emulate_time:
                wait_until(start + result.elapsed_s * self._time_scale)
        finally:
            self._last_end = time.perf_counter()
        self._last_outputs = result.outputs
        for seq in result.refused:  # the backend's own refusals (a schema its grammar cannot follow)
            self.metrics.refused_seqs.labels(field_kind(seq.field_name)).inc()
        return dataclasses.replace(result, refused=refused + result.refused) if refused else result

    def _count_tokens(self, plan: RoundPlan) -> None:
        prefill = sum(len(s.token_ids) for s in plan.seqs if s.is_prefill)
        decode = sum(len(s.token_ids) for s in plan.seqs if not s.is_prefill)
        self.metrics.tokens.labels("prefill").inc(prefill)
        self.metrics.tokens.labels("decode").inc(decode)
        if structured := sum(1 for s in plan.seqs if s.sample and s.sampling.json_schema):
            self.metrics.structured_tokens.inc(structured)

    # ---- KV transfer (prefill/decode disaggregation) ----------------------------------------------
    def kv_block_bytes(self) -> int:
        """Return the bytes of one transferred block. Raises Unavailable before the warm-up round, InvalidArgument
        for a backend that cannot move KV blocks."""
        return int(self._kv_backend().kv_block_bytes)

    def _kv_backend(self) -> Any:
        if not self.ready.is_set() or self._backend is None:
            raise Unavailable("the worker is not ready (loading or warming up)", reason="WORKER_LOADING")
        if not hasattr(self._backend, "read_kv_blocks"):
            raise InvalidArgument("this worker's backend cannot transfer KV blocks", field_name="block_ids")
        return self._backend

    async def read_kv(self, block_ids: list[int]) -> list[bytes]:
        """Return the raw bytes of each block (off the event loop; the backend's lock keeps rounds out)."""
        backend = self._kv_backend()
        limit = self.info().num_blocks
        if any(not 0 <= block < limit for block in block_ids):
            bad = next(block for block in block_ids if not 0 <= block < limit)
            raise InvalidArgument(f"KV block {bad} is out of range 0..{limit - 1}", field_name="block_ids")
        data: list[bytes] = await asyncio.to_thread(backend.read_kv_blocks, block_ids)
        self.metrics.kv_transfer_blocks.labels("sent").inc(len(block_ids))
        self.metrics.kv_transfer_bytes.labels("sent").inc(sum(len(d) for d in data))
        return data

    async def write_kv(self, block_ids: list[int], data: list[bytes] | list[memoryview]) -> None:
        """Store received blocks. Raises InvalidArgument for a block that does not fit this worker."""
        backend = self._kv_backend()
        try:
            await asyncio.to_thread(backend.write_kv_blocks, block_ids, data)
        except (ValueError, PlanError) as exc:
            raise InvalidArgument(str(exc), field_name="block_ids") from None
        self.metrics.kv_transfer_blocks.labels("received").inc(len(block_ids))
        self.metrics.kv_transfer_bytes.labels("received").inc(sum(len(d) for d in data))

    def close(self) -> None:
        """Stop the backend thread (after the round in flight)."""
        self._executor.shutdown(wait=True, cancel_futures=True)


KV_MESSAGE_BYTES = (4 << 20) - (64 << 10)
"""Most payload of one ReadKv message when the caller names no batch: whole blocks, under gRPC's default 4 MiB
receive limit with room for the framing (a bigger block goes alone; the pulling channel accepts up to
KV_MAX_MESSAGE_BYTES)."""
KV_MAX_MESSAGE_BYTES = 256 << 20


def blocks_per_message(asked: int, block_bytes: int) -> int:
    """Return the blocks one ReadKv message carries for a caller's `blocks_per_message` (0: about 4 MiB of whole
    blocks); a negative count, or one whose message would pass KV_MAX_MESSAGE_BYTES (protobuf cannot encode a
    message over 2 GiB at all), is INVALID_ARGUMENT naming the field."""
    if asked < 0:
        raise InvalidArgument(f"blocks_per_message must be >= 0, got {asked}", field_name="blocks_per_message")
    if asked == 0:
        return max(1, KV_MESSAGE_BYTES // max(block_bytes, 1))
    if asked > 1 and asked * block_bytes > KV_MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"blocks_per_message {asked} of {block_bytes}-byte blocks passes the "
                              f"{KV_MAX_MESSAGE_BYTES}-byte message limit", field_name="blocks_per_message")
    return asked


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin servicer: convert the plan, run it on the runtime, convert the result back."""

    def __init__(self, runtime: WorkerRuntime, tls_files: TlsFiles | None = None) -> None:
        self.runtime = runtime
        self.tls_files = tls_files
        self.round_link_port = 0
        """The round link's port, advertised in Info (0: not offered)."""
        self._peers: dict[str, grpc.aio.Channel] = {}
        """Channels to other workers this one pulled KV blocks from, by address."""

    async def ReadKv(self, request: worker_pb2.ReadKvRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.KvChunk]:
        """Stream the blocks' raw K/V bytes, `blocks_per_message` blocks per message (0: about 4 MiB each).
        Raises FailedPrecondition when the request names another incarnation of this worker (the fence)."""
        size = self.runtime.kv_block_bytes()
        if request.incarnation and request.incarnation != self.runtime.incarnation:
            self.runtime.metrics.kv_transfer_failures.inc()
            raise FailedPrecondition(f"the KV blocks were named by worker incarnation {request.incarnation}; this "
                                     f"worker is incarnation {self.runtime.incarnation} (it restarted: they are "
                                     "gone)", reason="kv_incarnation_changed", field_name="incarnation")
        per = blocks_per_message(request.blocks_per_message, size)
        ids = list(request.block_ids)
        for start in range(0, len(ids), per):
            batch = ids[start:start + per]
            data = await self.runtime.read_kv(batch)
            yield worker_pb2.KvChunk(block_ids=batch, data=b"".join(data), block_bytes=size)

    async def PullKv(self, request: worker_pb2.PullKvRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> worker_pb2.PullKvResponse:
        """Read blocks from the worker at `source_address` and write them into `block_ids` here, in order. A broken
        stream answers UNAVAILABLE (what arrived before the break is written but the caller must not use it); a
        source of another incarnation than `source_incarnation` answers FAILED_PRECONDITION (nothing written)."""
        if len(request.source_block_ids) != len(request.block_ids):
            raise InvalidArgument(f"{len(request.source_block_ids)} source blocks for {len(request.block_ids)} "
                                  "destination blocks", field_name="block_ids")
        if not request.source_address:
            raise InvalidArgument("source_address is required", field_name="source_address")
        size = self.runtime.kv_block_bytes()
        blocks_per_message(request.blocks_per_message, size)  # refused here, before the source is asked
        started = time.perf_counter()
        stub = worker_pb2_grpc.WorkerServiceStub(self._peer(request.source_address))
        destination = list(request.block_ids)
        done = moved = 0
        try:
            async for chunk in stub.ReadKv(worker_pb2.ReadKvRequest(
                    block_ids=request.source_block_ids, blocks_per_message=request.blocks_per_message,
                    incarnation=request.source_incarnation)):
                count, data = len(chunk.block_ids), chunk.data  # read the field once: each read copies it
                if chunk.block_bytes != size or len(data) != count * size or done + count > len(destination):
                    raise InvalidArgument(f"the source sends {chunk.block_bytes}-byte blocks, this worker's are "
                                          f"{size} bytes", field_name="source_address")
                view = memoryview(data)
                await self.runtime.write_kv(destination[done:done + count],
                                            [view[i * size:(i + 1) * size] for i in range(count)])
                done += count
                moved += len(data)
        except grpc.aio.AioRpcError as exc:
            self.runtime.metrics.kv_transfer_failures.inc()
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(f"the KV source {request.source_address} refused the pull: {exc.details()}",
                                         reason="kv_incarnation_changed", field_name="source_incarnation") from None
            raise Unavailable(f"the KV stream from {request.source_address} broke after {done} of "
                              f"{len(destination)} blocks: {exc.code().name} {exc.details()}",
                              reason="kv_source_unavailable") from None
        if done != len(destination):
            self.runtime.metrics.kv_transfer_failures.inc()
            raise Unavailable(f"the KV stream from {request.source_address} ended after {done} of "
                              f"{len(destination)} blocks", reason="kv_source_unavailable")
        return worker_pb2.PullKvResponse(blocks=done, bytes=moved, elapsed_s=time.perf_counter() - started)

    def _peer(self, address: str) -> grpc.aio.Channel:
        if address not in self._peers:
            self._peers[address] = tls.aio_channel(address, self.tls_files, (
                ("grpc.max_receive_message_length", KV_MAX_MESSAGE_BYTES),))
        return self._peers[address]

    async def Execute(self, request: worker_pb2.RoundPlan,  # noqa: N802 (gRPC method name)
                      context: grpc.aio.ServicerContext) -> worker_pb2.RoundResult:
        return await self._round(request, "Execute")

    async def ExecuteStream(self, request_iterator: AsyncIterator[worker_pb2.RoundPlan],  # noqa: N802
                            context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.RoundResult]:
        """Rounds in order (`rounds`)."""
        async with contextlib.aclosing(self.rounds(request_iterator, context.done)) as results:
            async for result in results:
                yield result

    async def rounds(self, plans: AsyncIterator[worker_pb2.RoundPlan], closed: Callable[[], bool],
                     rpc: str = "ExecuteStream") -> AsyncGenerator[worker_pb2.RoundResult, None]:
        """Answer a stream of plans in order, ExecuteStream's and the round link's alike (worker_svc/round_link.py).

        Each plan is converted, validated and queued on the backend thread as it arrives, so a round queued by the
        pipelined scheduler starts the moment the one before ends (in that thread, with no hop through the event
        loop); results are converted and yielded in order as they come. Stops once `closed()` (nobody reads the
        results); rounds queued and not started are then cancelled. Raises what reading `plans` raised (a message
        that does not parse, Unavailable before warm-up) once the rounds before it are answered."""
        queued: asyncio.Queue[tuple[worker_pb2.RoundPlan, RoundPlan, asyncio.Future[RoundResult] | RoundResult]
                              | Exception | None] = asyncio.Queue()
        runtime = self.runtime

        async def read() -> None:
            try:
                async for wire in plans:
                    plan = convert.plan_from_proto(wire)
                    try:
                        runs, refused = runtime.validate(plan)
                    except InvalidArgument as exc:  # this plan only: its round fails, the stream goes on
                        queued.put_nowait((wire, plan, runtime.queue_refusal(plan, exc)))
                        continue
                    queued.put_nowait((wire, runs, runtime.queue(runs, refused, rpc)))
            except Exception as exc:  # a message that does not parse, Unavailable before warm-up: the stream ends
                queued.put_nowait(exc)
            finally:
                queued.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queued.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                wire, plan, pending = item
                result = pending if isinstance(pending, RoundResult) else await self._finished(wire, plan, pending, rpc)
                if closed():  # the scheduler closed the stream: nobody reads this result
                    return
                yield convert.result_to_proto(result)
        finally:
            reader.cancel()
            while not queued.empty():  # rounds of a closed stream that have not started do not run
                left = queued.get_nowait()
                if isinstance(left, tuple) and isinstance(left[2], asyncio.Future):
                    left[2].cancel()

    async def _round(self, wire: worker_pb2.RoundPlan, rpc: str) -> worker_pb2.RoundResult:
        return convert.result_to_proto(await self._execute(wire, convert.plan_from_proto(wire), rpc))

    async def _execute(self, wire: worker_pb2.RoundPlan, plan: RoundPlan, rpc: str) -> RoundResult:
        """Run one converted plan; a plan that carries trace contexts gets a `worker.round` span."""
        return await self._traced(wire, plan, rpc, self.runtime.execute(plan, rpc))

    async def _finished(self, wire: worker_pb2.RoundPlan, plan: RoundPlan,
                        future: asyncio.Future[RoundResult], rpc: str) -> RoundResult:
        """Await a round queued on the stream (its span, if any, starts when its answer is awaited: the round
        before it has been answered)."""
        return await self._traced(wire, plan, rpc, self.runtime.finished(plan, future))

    async def _traced(self, wire: worker_pb2.RoundPlan, plan: RoundPlan, rpc: str,
                      running: Coroutine[Any, Any, RoundResult]) -> RoundResult:
        if not wire.traces:
            return await running
        links = [link for t in wire.traces
                 if (link := telemetry.link_to(t.traceparent, t.tracestate, **{"sluice.request_id": t.request_id}))]
        with tracer.start_as_current_span("worker.round", kind=trace.SpanKind.SERVER, links=links, attributes={
                "sluice.round_id": plan.round_id, "sluice.seqs": len(plan.seqs), "rpc.method": rpc}) as span:
            result = await running
            span.set_attribute("sluice.elapsed_s", result.elapsed_s)
            for refused in result.refused:
                span.add_event("seq_refused", attributes={"sluice.request_id": refused.request_id,
                                                          "sluice.field": refused.field_name,
                                                          "message": refused.message})
            if result.error:
                span.set_status(trace.Status(trace.StatusCode.ERROR, result.error))
        return result

    async def Info(self, request: worker_pb2.InfoRequest,  # noqa: N802
                   context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        reply = convert.info_to_proto(self.runtime.info())
        reply.incarnation = self.runtime.incarnation
        reply.round_link_port = self.round_link_port
        return reply


@dataclasses.dataclass
class RunningWorker:
    """A started worker server: the gRPC server, its port, health servicer, the loading task and the round link."""

    server: grpc.aio.Server
    port: int
    runtime: WorkerRuntime
    health: health_aio.HealthServicer
    loading: asyncio.Task[None]
    round_link: RoundLinkServer | None = None

    async def stop(self, grace_s: float = 1.0) -> None:
        """Report NOT_SERVING, stop the server (letting RPCs in flight finish within grace_s) and the backend."""
        await self.health.enter_graceful_shutdown()
        self.loading.cancel()
        if self.round_link is not None:
            await self.round_link.close()
        await self.server.stop(grace_s)
        self.runtime.close()


async def start_worker_server(runtime: WorkerRuntime, port: int = 0, host: str = "127.0.0.1",
                              tls_files: TlsFiles | None = None, round_link_port: int | None = 0) -> RunningWorker:
    """Start the gRPC server at once (health NOT_SERVING) and load the backend in the background.

    `round_link_port`: where to offer the round link (worker_svc/round_link.py) on `host`, 0 a free port, None
    not at all. Returns the running worker; health turns SERVING when the warm-up round has run. Loading errors are
    logged and leave the worker NOT_SERVING. Raises RuntimeError when a port cannot be bound.
    """
    authorize = tls.authorizer() if tls_files is not None else None
    server = grpc_server(SERVICE_NAME, interceptors=[ErrorInterceptor(authorize=authorize)])
    servicer = WorkerServicer(runtime, tls_files)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    bound = tls.listen(server, f"{host}:{port}", tls_files)
    if bound == 0:
        raise RuntimeError(f"cannot bind the worker to {host}:{port}")
    link = None
    if round_link_port is not None:
        link = RoundLinkServer(servicer.rounds, runtime.metrics, tls_files)
        try:
            servicer.round_link_port = await link.start(host, round_link_port)
        except OSError as exc:
            raise RuntimeError(f"cannot bind the worker's round link to {host}:{round_link_port}: {exc}") from None
    await server.start()

    async def load() -> None:
        try:
            await runtime.start()
        except Exception:
            log.exception("the worker failed to load; it stays NOT_SERVING")
            return
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)

    return RunningWorker(server, bound, runtime, health, asyncio.create_task(load()), link)
