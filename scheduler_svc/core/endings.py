"""How requests end: cancels, timeouts, finishes and failures, each entered exactly once.

A request that no in-flight round reads ends at once: its blocks return to the pool and its host
copies to the host blocks. One that a round still reads (or whose swap-out copy is in flight)
waits in CANCELLING with its `release_input`; the round's result (or its loss) releases it.
Every end emits one Finished record, a FINISHED event and, when it held blocks, KV_RELEASED.
A request that ends while a round placed ahead still reads it (overlap scheduling: a stop token in
the round before) ends at once, but its blocks stay pinned (`held_blocks`) until that round answers.
"""

from __future__ import annotations

import dataclasses
from array import array

from scheduler_svc.core.backlog import Backlog
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.deadlines import DeadlineHeap
from scheduler_svc.core.handoffs import HandOffs
from scheduler_svc.core.host_blocks import HostBlocks
from scheduler_svc.core.outbox import Outbox
from scheduler_svc.core.request import Request
from scheduler_svc.core.state import Input, apply
from scheduler_svc.core.table import RequestTable
from sluice.types import KV_HELD, Finished, RequestStatus, Stage

_FINISH_REASON = {
    RequestStatus.FINISHED_STOP: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.CANCELLED: "cancelled",
    RequestStatus.TIMED_OUT: "timeout",
    RequestStatus.FAILED: "error",
}


class Endings:
    """Ends requests of one core: cancel, expire, finish, fail, and deferred releases."""

    __slots__ = ("_table", "_backlog", "_pool", "_host", "_outbox", "_deadlines", "_deferred_detail", "handoffs")

    def __init__(
        self,
        table: RequestTable,
        backlog: Backlog,
        pool: BlockPool,
        host: HostBlocks,
        outbox: Outbox,
        deadlines: DeadlineHeap,
        handoffs: HandOffs | None = None,
    ) -> None:
        self._table = table
        self._backlog = backlog
        self._pool = pool
        self._host = host
        self._outbox = outbox
        self._deadlines = deadlines
        self._deferred_detail: dict[str, str] = {}
        """Detail of a cancel that waits for its round (CANCELLING), for the Finished record."""
        self.handoffs = handoffs if handoffs is not None else HandOffs(pool, 30.0, 1)
        """Prompt blocks of finished prefill requests held for a decode replica's transfer (handoffs.py)."""

    def cancel(self, request_id: str, now: float, detail: str = "") -> RequestStatus | None:
        """Cancel a request and return its status afterwards (None for an unknown id).

        Waiting or idle requests end at once; one read by an in-flight round is CANCELLING
        until that round's result arrives. Cancelling again, or a finished request, changes nothing.
        `detail` goes into its Finished record (a drain's hand-off says so there).
        """
        request = self._table.live.get(request_id)
        if request is None:
            self.handoffs.release(request_id)  # a held prefill: cancelling it ends the hand-off too
            return self._table.ended_status(request_id)
        if request.status is RequestStatus.CANCELLING:
            return request.status
        self._outbox.event(request, Stage.CANCEL_REQUESTED, now)
        return self._terminate(request, Input.CANCEL, Input.CANCEL_DEFERRED, now, detail)

    def expire(self, now: float) -> list[str]:
        """Time out every request whose queue or total deadline is <= now; return their ids."""
        expired: list[str] = []
        for request in self._deadlines.expired(now):
            self._terminate(request, Input.TIMEOUT, Input.TIMEOUT_DEFERRED, now)
            expired.append(request.request_id)
        return expired

    def _terminate(self, request: Request, now_input: Input, deferred: Input, now: float,
                   detail: str = "") -> RequestStatus:
        table = self._table
        if request.in_flight_round is not None:
            table.running.pop(request.request_id, None)
            table.swapping.pop(request.request_id, None)
            apply(request, deferred)
            self._backlog.set_pending(request, 0)
            is_cancel = deferred is Input.CANCEL_DEFERRED
            request.release_input = Input.RELEASE_CANCELLED if is_cancel else Input.RELEASE_TIMED_OUT
            table.cancelling[request.request_id] = request
            if detail:
                self._deferred_detail[request.request_id] = detail
            return request.status
        if request.status is RequestStatus.WAITING:
            self._backlog.dequeue(request)
        else:
            table.running.pop(request.request_id, None)
        self.end(request, now_input, now, detail)
        return request.status

    def release_deferred(self, request: Request, now: float) -> None:
        """End a CANCELLING request now that no round reads it."""
        del self._table.cancelling[request.request_id]
        detail = self._deferred_detail.pop(request.request_id, "")
        self.end(request, request.release_input, now, detail)  # type: ignore[arg-type]

    def end_running(self, request: Request, event: Input, now: float, detail: str = "") -> None:
        """End a RUNNING request with `event` (STOP, LENGTH or FAIL)."""
        del self._table.running[request.request_id]
        self.end(request, event, now, detail)

    def end(self, request: Request, event: Input, now: float, detail: str = "") -> None:
        """Enter a terminal status, release blocks and emit the Finished record (exactly once)."""
        status = apply(request, event)
        backlog = self._backlog
        if request.pending_prefill:
            backlog.set_pending(request, 0)
        if self.handoffs.on_end(request.request_id, status is RequestStatus.FINISHED_LENGTH,
                                tuple(request.block_ids), request.num_prompt, now) and not detail:
            detail = KV_HELD
        released = self._release_blocks(request)
        self._table.forget(request, status)
        if backlog.account is not None:
            backlog.queue.on_live(request.tenant, -1, now)
        usage = request.usage
        usage.output_tokens = request.num_outputs
        outbox = self._outbox
        outbox.events.finished.append(
            Finished(
                request_id=request.request_id,
                tenant=request.tenant,
                status=status,
                finish_reason=_FINISH_REASON[status],
                usage=dataclasses.replace(usage),
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finish_time=now,
                output_token_ids=request.output_ids,
                detail=detail,
            )
        )
        outbox.event(request, Stage.FINISHED, now, (("status", status.value),))
        if released:
            outbox.event(request, Stage.KV_RELEASED, now)

    def _release_blocks(self, request: Request) -> bool:
        released = bool(request.block_ids or request.host_blocks)
        if request.loads:  # host-tier hits it will not copy in now
            self._host.unread(copy.src for copy in request.loads)
            request.loads = ()
        if request.block_ids:
            if request.in_flight_round is not None:  # still read by a round placed ahead
                self._pool.pin(request.block_ids)
                request.held_blocks = request.block_ids
            self._pool.free(reversed(request.block_ids))
            request.block_ids = array("q")
            request.block_table = ()
        if request.host_blocks:
            self._host.release(request.host_blocks)
            request.host_blocks = ()
        return released
