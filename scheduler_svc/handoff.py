"""Prefill/decode hand-offs at a replica's scheduler: holding KV blocks (prefill side) and pulling them (decode side).

Theory of operation (docs/disaggregation.md, "Live mode")
- Prefill side: a Submit with `hold_kv` is the prompt half of a pair (max_tokens 1). When it ends FINISHED_LENGTH
  the core pins its prompt's full blocks (scheduler_svc/core/handoffs.py) and its completion says so (detail
  KV_HELD). `HeldKv` answers the block ids and this replica's worker address; `ReleaseKv` (the decode side has
  them, or gave up), a Cancel of the request id, or the hold's expiry (`kv_hold_s`, 30 s) unpins them.
- Decode side: a Submit with `kv_source` is the decode half (prompt + the first token, max_tokens - 1). Before the
  request queues, `KvReceiver.receive` asks the prefill scheduler `HeldKv`, allocates as many blocks here
  (`BlockPool.allocate`), has this replica's worker pull them from the prefill worker over a gRPC stream
  (`WorkerService.PullKv` -> the prefill worker's `ReadKv`), registers their hashes (so the core's prefix cache
  finds them: its first round computes the partial last block and the new token only) and releases the hold.
  Then the request is submitted to the core as any other; the received blocks keep their reference until the
  core has placed the request (it then holds its own), so no allocation can evict them in between.
- The pull is fenced by the prefill worker's incarnation (WorkerInfo.incarnation, new on every start): HeldKv
  answers the incarnation the held blocks were written under, and the prefill worker refuses a ReadKv for another
  one (FAILED_PRECONDITION), so a worker restarted between the HeldKv answer and the pull never serves its empty
  blocks as the prompt's (outcome `stale`).
- No room here for the blocks: the pull waits for room (`room_wait_s`, `--kv-room-wait`, 5 s; bounded by the
  hold's expiry and by the Submit's own deadline, each less a margin for the pull itself), trying again after each
  round planned here and at least every 20 ms; waiters are not ordered among themselves. Counted in
  sluice_kv_room_waits_total{outcome} and sluice_kv_room_wait_seconds; span events waiting_for_room then
  room_found or room_wait_timed_out.
- Anything that fails (the prefill scheduler or worker unreachable, the stream cut mid-way, no hold there, a stale
  incarnation) or no room here in time: the allocated blocks are freed unregistered and the request is submitted without them, so the
  prompt is recomputed here: nothing is lost and nothing runs twice (the request is queued exactly once).
- A Cancel while the blocks move stops the pull, frees both sides (ReleaseKv at the prefill side) and ends the
  request CANCELLED through the core (submitted and cancelled at once), so its completion is published as any
  cancelled request's is.
- Trace: a `replica.kv_transfer` span (a child of admission's) with events transfer_started, transfer_done or
  transfer_failed (reason); metrics in sluice.prom.SchedulerMetrics (sluice_kv_transfers_total{outcome}, blocks,
  bytes, seconds; the prefill side's sluice_kv_held_blocks and sluice_kv_holds_ended_total{reason}).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from sluice import errors, telemetry, tls
from sluice.hashing import hash_chain, salt_of
from sluice.tls import TlsFiles
from sluice.types import RequestStatus
from sluice.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from scheduler_svc.driver import Driver

__all__ = ["KvReceiver"]

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer("sluice.scheduler")

HELD_KV_TIMEOUT_S = 5.0
"""Timeout of the HeldKv and ReleaseKv calls to the prefill scheduler."""
PULL_TIMEOUT_S = 60.0
"""Timeout of one PullKv (the whole stream of one request's blocks)."""
ROOM_MARGIN_S = 1.0
"""A wait for room ends this long before the hold lapses or the Submit's deadline passes: time left to pull."""
ROOM_POLL_S = 0.02
"""A wait for room tries again at least this often (and after each round planned here)."""


@dataclass
class Incoming:
    """One decode-side request whose blocks are on their way."""

    task: asyncio.Task[str] | None = None
    blocks: list[int] = field(default_factory=list)
    """Blocks allocated here for the transfer (freed on failure; registered and held until placed on success)."""
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the request is in the core (or refused): a Cancel waits for it."""


class KvReceiver:
    """Both sides of the hand-off for one replica (see the module docstring)."""

    def __init__(self, driver: Driver, worker: worker_pb2_grpc.WorkerServiceStub, worker_address: str,
                 tls_files: TlsFiles | None = None, room_wait_s: float = 5.0) -> None:
        if room_wait_s < 0:
            raise ValueError(f"--kv-room-wait must be >= 0 seconds, got {room_wait_s}")
        self.driver = driver
        self.room_wait_s = room_wait_s
        """Decode side: the most a hand-off waits for room here before the prompt is recomputed (0: never waits)."""
        self._room = asyncio.Event()
        """Set after each round planned here (blocks may have been freed): waiters for room try again."""
        self.worker = worker
        self.worker_address = worker_address
        """This replica's worker as other workers reach it (HeldKv tells decode replicas)."""
        self.tls_files = tls_files
        self.incoming: dict[str, Incoming] = {}
        self.placing: dict[str, list[int]] = {}
        """Received blocks held until the core has placed their request."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._expired_seen = 0
        core = driver.core
        driver.metrics.kv_held_blocks.set_function(lambda: core.handoffs.held_blocks)

    # ---- prefill side ----------------------------------------------------------------------------
    def held(self, request_id: str) -> scheduler_pb2.HeldKvResponse | None:
        """Return what `request_id` holds for its decode replica, or None."""
        blocks = self.driver.core.held_kv(request_id)
        if blocks is None:
            return None
        hold = self.driver.core.handoffs.held(request_id)
        expires_in = max(0.0, hold.expires_at - self.driver.clock()) if hold is not None else 0.0
        return scheduler_pb2.HeldKvResponse(worker_address=self.worker_address, block_ids=blocks,
                                            block_size=self.driver.core.config.block_size,
                                            worker_incarnation=self.driver.worker_incarnation,
                                            expires_in_s=expires_in)

    def release(self, request_id: str, reason: str) -> int:
        """End `request_id`'s hold; return the blocks unpinned."""
        blocks = self.driver.core.release_held_kv(request_id)
        if blocks:
            self.driver.metrics.kv_holds_ended.labels(reason or "received").inc()
            self.driver.wake_up()  # freed blocks may let a waiting request in
        return blocks

    def count_expired(self) -> None:
        """Count the holds the core's expiry ended since the last call."""
        expired = self.driver.core.handoffs.expired
        if expired > self._expired_seen:
            self.driver.metrics.kv_holds_ended.labels("expired").inc(expired - self._expired_seen)
            self._expired_seen = expired

    # ---- decode side -----------------------------------------------------------------------------
    async def receive(self, msg: scheduler_pb2.SubmitRequest, parent: Context | None,
                      time_left_s: float | None = None) -> int:
        """Pull the blocks `msg.kv_source` holds, then submit `msg` to the core; return its queue position.
        `time_left_s`: until the Submit's deadline (None: none), which bounds a wait for room.

        Raises what `Driver.submit` raises (the core refused the request): the blocks are freed then."""
        request_id = msg.request_id
        if request_id in self.incoming:
            raise errors.InvalidArgument(f"request {request_id!r} is already being received here",
                                         field_name="request_id")
        entry = self.incoming[request_id] = Incoming()
        span = tracer.start_span("replica.kv_transfer", context=parent, attributes={
            "sluice.request_id": request_id, "sluice.replica_id": self.driver.replica_id,
            "sluice.prefill_replica_id": msg.kv_source.replica_id})
        started = time.perf_counter()
        entry.task = asyncio.ensure_future(self._pull(msg, entry, span, time_left_s))
        try:
            outcome = await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            if not (entry.cancelled and entry.task.done()):  # the Submit call itself went away (its caller is gone)
                entry.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await entry.task
                self._free(entry)
                self.incoming.pop(request_id, None)
                entry.done.set()
                span.end()
                raise
            outcome = "cancelled"  # a Cancel stopped the pull before it started
            self._spawn(self._release_source(msg.kv_source, outcome))
        metrics = self.driver.metrics
        metrics.kv_transfers.labels(outcome).inc()
        if outcome == "received":
            metrics.kv_transfer_duration.observe(time.perf_counter() - started)
        span.end()
        try:
            position = self.driver.submit(msg, parent)
        except BaseException:
            self._free(entry)
            raise
        finally:
            self.incoming.pop(request_id, None)
            entry.done.set()
        if entry.blocks:
            self.placing[request_id] = entry.blocks
            self.on_scheduled()
        if entry.cancelled:
            self.driver.cancel(request_id, "cancelled during the KV transfer")
        return position

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request whose blocks are on their way; False when none is. Returns once it is in the core
        (and cancelled there) or refused."""
        entry = self.incoming.get(request_id)
        if entry is None:
            return False
        entry.cancelled = True
        if entry.task is not None:
            entry.task.cancel()
        await entry.done.wait()
        return True

    def on_scheduled(self) -> None:
        """After a round is planned: drop the received blocks' references of requests the core has placed (they
        hold their own) or ended, and count holds that expired."""
        self.count_expired()
        self._room.set()
        if not self.placing:
            return
        core = self.driver.core
        for request_id in list(self.placing):
            status = core.request_status(request_id)
            if status is not RequestStatus.WAITING:
                core.pool.free(reversed(self.placing.pop(request_id)))

    async def _pull(self, msg: scheduler_pb2.SubmitRequest, entry: Incoming, span: trace.Span,
                    time_left_s: float | None = None) -> str:
        """Move the blocks; return the outcome: received, failed, stale (the prefill worker restarted since the hold
        began), no_room (then the prompt is recomputed here),
        empty (a prompt shorter than a block: nothing is held, its few tokens are computed here) or cancelled."""
        source = msg.kv_source
        core = self.driver.core
        span.add_event("transfer_started", attributes={"sluice.kv_source": source.scheduler_address})
        reason = "received"
        try:
            if not core.pool.caching:
                reason = "no_room"
                return self._failed(span, "no_room", "prefix caching is off here: the prompt is recomputed")
            if (len(msg.prompt_token_ids) - 1) // core.config.block_size == 0:  # the prefill prompt fills no block
                span.add_event("transfer_failed", attributes={"reason": "empty"})
                return "empty"
            try:
                held = await self._scheduler(source.scheduler_address).HeldKv(
                    scheduler_pb2.HeldKvRequest(request_id=source.request_id), timeout=HELD_KV_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                reason = "failed"
                return self._failed(span, "failed", f"HeldKv at {source.scheduler_address}: {exc.code().name}")
            if held.block_size != core.config.block_size or not held.block_ids:
                reason = "failed"
                return self._failed(span, "failed", f"{len(held.block_ids)} blocks of {held.block_size} tokens "
                                                     f"held; this replica's blocks have {core.config.block_size}")
            count = len(held.block_ids)
            blocks = core.pool.allocate(count)
            if blocks is None:
                blocks = await self._wait_for_room(count, held.expires_in_s, time_left_s, span)
            if blocks is None:
                reason = "no_room"
                return self._failed(span, "no_room", f"no room for {count} blocks here")
            entry.blocks = blocks
            try:
                reply = await self.worker.PullKv(worker_pb2.PullKvRequest(
                    source_address=held.worker_address, source_block_ids=held.block_ids, block_ids=blocks,
                    source_incarnation=held.worker_incarnation),
                    timeout=PULL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                self._free(entry)
                reason = "failed"
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the fence: the prefill worker restarted
                    reason = "stale"
                    return self._failed(span, "stale", f"PullKv from {held.worker_address}: {exc.details()}")
                return self._failed(span, "failed", f"PullKv from {held.worker_address}: {exc.code().name} "
                                                     f"{exc.details()}")
            self._register(msg, blocks)
            metrics = self.driver.metrics
            metrics.kv_transfer_blocks.inc(reply.blocks)
            metrics.kv_transfer_bytes.inc(reply.bytes)
            span.add_event("transfer_done", attributes={"sluice.blocks": reply.blocks, "sluice.bytes": reply.bytes,
                                                        "sluice.transfer_s": reply.elapsed_s})
            return "received"
        except asyncio.CancelledError:
            self._free(entry)
            reason = "cancelled"
            span.add_event("transfer_failed", attributes={"reason": "cancelled"})
            return "cancelled"
        finally:
            self._spawn(self._release_source(source, reason))

    async def _wait_for_room(self, count: int, expires_in_s: float, time_left_s: float | None,
                             span: trace.Span) -> list[int] | None:
        """Wait until `count` blocks can be allocated here; return them, or None when the wait is over first (at
        most `room_wait_s`, and ROOM_MARGIN_S before the hold lapses or the Submit's deadline). Raises
        CancelledError when a Cancel stops it."""
        limits = [self.room_wait_s, (expires_in_s or float("inf")) - ROOM_MARGIN_S]
        if time_left_s is not None:
            limits.append(time_left_s - ROOM_MARGIN_S)
        limit = min(limits)
        if limit <= 0:
            return None
        loop, metrics, pool = asyncio.get_running_loop(), self.driver.metrics, self.driver.core.pool
        span.add_event("waiting_for_room", attributes={"sluice.blocks": count, "sluice.wait_limit_s": limit})
        started = loop.time()
        deadline = started + limit
        blocks, outcome = None, "timeout"
        try:
            while (remaining := deadline - loop.time()) > 0:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout=min(ROOM_POLL_S, remaining))
                blocks = pool.allocate(count)
                if blocks is not None:
                    outcome = "room"
                    break
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            waited = loop.time() - started
            metrics.kv_room_waits.labels(outcome).inc()
            metrics.kv_room_wait_duration.observe(waited)
            span.add_event("room_found" if outcome == "room" else "room_wait_timed_out" if outcome == "timeout"
                           else "room_wait_cancelled", attributes={"sluice.waited_s": waited})
        return blocks

    def _failed(self, span: trace.Span, outcome: str, detail: str) -> str:
        log.warning("KV hand-off not received (%s): %s; the prompt is recomputed here", outcome, detail)
        span.add_event("transfer_failed", attributes={"reason": outcome, "detail": detail})
        return outcome

    def _register(self, msg: scheduler_pb2.SubmitRequest, blocks: list[int]) -> None:
        """Give the received full blocks their hashes, as the core names this request's blocks (its salt)."""
        core = self.driver.core
        config, size = core.config, core.config.block_size
        salt = (salt_of(config.model_id, config.adapter_version, msg.cache_salt) if msg.cache_salt
                else salt_of(config.model_id, config.adapter_version))
        hashes = hash_chain(list(msg.prompt_token_ids[:len(blocks) * size]), size, salt)
        parent = 0
        for block, block_hash in zip(blocks, hashes, strict=True):
            core.pool.register(block, block_hash, parent)
            parent = block_hash

    def _free(self, entry: Incoming) -> None:
        if entry.blocks:
            self.driver.core.pool.free(reversed(entry.blocks))
            entry.blocks = []

    async def _release_source(self, source: scheduler_pb2.KvSource, reason: str) -> None:
        """Tell the prefill side its hold is done (best effort: its expiry ends it otherwise)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._scheduler(source.scheduler_address).ReleaseKv(
                scheduler_pb2.ReleaseKvRequest(request_id=source.request_id, reason=reason),
                timeout=HELD_KV_TIMEOUT_S)

    def _scheduler(self, address: str) -> scheduler_pb2_grpc.SchedulerServiceStub:
        if address not in self._channels:
            self._channels[address] = tls.aio_channel(address, self.tls_files)
        return scheduler_pb2_grpc.SchedulerServiceStub(self._channels[address])

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait briefly for background releases, close the channels."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        for channel in self._channels.values():
            await channel.close()
