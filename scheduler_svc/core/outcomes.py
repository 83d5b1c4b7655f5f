"""What happens after a round is planned: results, finishes, cancels, timeouts and releases.

Split from `scheduler.py` (which builds rounds) along the step cycle: this half consumes
`RoundResult`s and ends requests. Both halves share the ledgers declared on `_Outcomes`.

Readers are tracked per request, not per block: a request placed in a round gets
`in_flight_round` set, and its blocks stay referenced until that round's result arrives, even if
the request was cancelled or timed out meanwhile (it waits in CANCELLING). A swap-out victim's
device blocks are pinned in the pool for the same duration.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.policies import WaitingQueue
from scheduler_svc.core.request import Request
from scheduler_svc.core.round import InFlightRound
from scheduler_svc.core.state import Input, apply
from sluice.hashing import block_hash
from sluice.types import (
    CoreEvents,
    Finished,
    LifecycleEvent,
    RequestStatus,
    RoundResult,
    SeqOutput,
    Stage,
)

_FINISH_REASON = {
    RequestStatus.FINISHED_STOP: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.CANCELLED: "cancelled",
    RequestStatus.TIMED_OUT: "timeout",
    RequestStatus.FAILED: "error",
}
_QUEUE_DEADLINE = 0
_TOTAL_DEADLINE = 1
TERMINAL_MEMORY = 65536
"""How many finished request ids `cancel` and `request_status` still recognise."""


class _Outcomes:
    """Round results and terminations (mixed into SchedulerCore)."""

    config: SchedulerConfig
    replica_id: str
    pool: BlockPool
    _queue: WaitingQueue
    _live: dict[str, Request]
    _running: dict[str, Request]
    _swapping: dict[str, Request]
    _cancelling: dict[str, Request]
    _in_flight: dict[int, InFlightRound]
    _host_free: list[int]
    _deadlines: list[tuple[float, int, int, Request]]
    _terminal: OrderedDict[str, RequestStatus]
    _outbox: CoreEvents
    _dropped_total: int
    _counts: dict[RequestStatus, int]
    _queued_prefill_tokens: int
    _preemptions: int
    _salt: int
    _block_size: int

    # ---- results ---------------------------------------------------------------------------
    def on_round_result(self, result: RoundResult, now: float) -> CoreEvents:
        """Apply a worker's result for a planned round and return the drained outbox.

        Outputs for unknown rounds, requests that are gone or cancelling, or older epochs are
        dropped and counted (`dropped_results`); they never resurrect a request.
        """
        record = self._in_flight.pop(result.round_id, None)
        if record is None:
            self._drop(len(result.outputs))
        elif result.error:
            self._drop(sum(1 for out in result.outputs if out.token_ids))
            self._fail_round(record, result.error, now)
        else:
            self._apply_outputs(record, result.outputs, now)
            if record.swapping:
                self._finish_swaps(record, now)
        return self.take_events()  # type: ignore[attr-defined, no-any-return]

    def _apply_outputs(self, record: InFlightRound, outputs: tuple[SeqOutput, ...], now: float) -> None:
        by_id = {out.request_id: out for out in outputs}
        if len(by_id) != len(outputs):
            by_id = self._newest_outputs(outputs)
        pop = by_id.pop
        emit = self._outbox.tokens.append
        block_size = self._block_size
        caching = self.pool.caching
        account = self._account  # type: ignore[attr-defined]
        running = RequestStatus.RUNNING
        for request, num_tokens, sample, _ in record.entries:
            request.in_flight_round = None
            if request.lost_rounds:
                request.lost_rounds = 0
            out = pop(request.request_id, None)
            if request.status is not running:
                if out is not None and out.token_ids:
                    self._drop(1)
                self._release_deferred(request, now)
                continue
            computed = request.num_computed = request.num_computed + num_tokens
            if caching and computed // block_size > request.num_registered:
                self._register_full_blocks(request)
            if not sample:
                if out is not None and out.token_ids:
                    self._drop(1)
            elif out is None or out.epoch != request.epoch or not out.token_ids:
                if out is not None:
                    self._drop(1)
                detail = f"round {record.round_id} returned no token for epoch {request.epoch}"
                self._end_running(request, Input.FAIL, now, detail)
            else:
                token_ids = out.token_ids
                token = token_ids[0]
                tokens = request.tokens
                index = len(tokens) - request.num_prompt
                tokens.append(token)
                emit((request.request_id, index, token))
                # One test for the common case; the rare ones (first token, finish, fair-share
                # accounting, extra tokens) are sorted out in _after_token.
                if (
                    index == 0
                    or index + 1 >= request.max_tokens
                    or token == request.eos_token_id
                    or out.stop_string_hit
                    or len(token_ids) != 1
                    or account is not None
                    or (request.stop_token_ids and token in request.stop_token_ids)
                ):
                    self._after_token(request, out, index, token, now)
        if by_id:
            self._drop(len(by_id))
        if record.host_release:
            self._host_free.extend(record.host_release)

    def _newest_outputs(self, outputs: tuple[SeqOutput, ...]) -> dict[str, SeqOutput]:
        """Keep one output per request (the newest epoch); count the others as dropped."""
        by_id: dict[str, SeqOutput] = {}
        for out in outputs:
            kept = by_id.get(out.request_id)
            if kept is not None:
                self._drop(1)
                if kept.epoch >= out.epoch:
                    continue
            by_id[out.request_id] = out
        return by_id

    def _after_token(self, request: Request, out: SeqOutput, index: int, token: int, now: float) -> None:
        """Everything but the append for output token `index`: first token, accounting, finishing."""
        if len(out.token_ids) > 1:
            self._drop(len(out.token_ids) - 1)
        if index == 0:
            request.first_token_time = now
            self._event(request, Stage.FIRST_TOKEN, now)
        account = self._account  # type: ignore[attr-defined]
        if account is not None:
            account(request.tenant, 0, 1)
        if token == request.eos_token_id or token in request.stop_token_ids or out.stop_string_hit:
            self._end_running(request, Input.STOP, now)
        elif index + 1 >= request.max_tokens:
            self._end_running(request, Input.LENGTH, now)

    def _register_full_blocks(self, request: Request) -> None:
        """Register the hash of each block that became full and computed (STORED events)."""
        size = self._block_size
        full = request.num_computed // size
        hashes = self._hashes_upto(request, full)
        register = self.pool.register
        for index in range(request.num_registered, full):
            register(request.block_ids[index], hashes[index], hashes[index - 1] if index else 0)
        request.num_registered = full

    def _hashes_upto(self, request: Request, count: int) -> list[int]:
        """Return the request's block-hash chain, extended to at least `count` full blocks."""
        hashes = request.block_hashes
        size, salt, tokens = self._block_size, self._salt, request.tokens
        while len(hashes) < count:
            start = len(hashes) * size
            hashes.append(block_hash(hashes[-1] if hashes else 0, salt, tokens[start : start + size]))
        return hashes

    def _finish_swaps(self, record: InFlightRound, now: float, copied: bool = True) -> None:
        """Unpin swap-out victims' device blocks and re-queue them (or release cancelled ones).

        When the round failed, the host copies cannot be trusted: the victim drops them and
        resumes by recompute instead.
        """
        for victim in record.swapping:
            self.pool.unpin(reversed(victim.swap_pinned))
            victim.swap_pinned = []
            victim.in_flight_round = None
            if victim.status is RequestStatus.CANCELLING:
                self._release_deferred(victim, now)
                continue
            if not copied:
                self._host_free.extend(victim.host_blocks)
                victim.host_blocks = []
                victim.recompute_debt = max(victim.recompute_debt, victim.num_computed)
                victim.num_computed = 0
            del self._swapping[victim.request_id]
            apply(victim, Input.REQUEUE)
            self._enqueue(victim)

    def on_round_lost(self, round_id: int, now: float) -> CoreEvents:
        """The worker went away with round `round_id` in flight; return the drained outbox.

        Nothing of that round is known to have been computed and the worker's KV is gone, so each
        running request of the round is preempted by recompute (PREEMPTED with mode "recompute" and
        cause "worker_lost") and waits again in its place; cancelling ones are released; swap copies
        of the round count as not done. The rest of the worker's KV is gone too: running requests
        outside any in-flight round are recomputed as well, and swapped-out waiting requests drop
        their host copies. A request lost in more than `max_lost_rounds` consecutive
        rounds fails instead, so a plan that kills the worker cannot loop forever. A late result
        for the round is dropped (unknown round, older epoch). An unknown round changes nothing.
        """
        record = self._in_flight.pop(round_id, None)
        if record is not None:
            limit = self.config.max_lost_rounds
            for request, _, _, _ in record.entries:
                request.in_flight_round = None
                if request.status is not RequestStatus.RUNNING:
                    self._release_deferred(request, now)
                    continue
                request.lost_rounds += 1
                if request.lost_rounds > limit:
                    detail = (f"round {round_id} lost with the worker; the request was lost in "
                              f"{request.lost_rounds} consecutive rounds (max_lost_rounds {limit})")
                    self._end_running(request, Input.FAIL, now, detail)
                else:
                    self._requeue_lost(request, now)
            self._finish_swaps(record, now, copied=False)
            self._host_free.extend(record.host_release)
            self._forget_worker_kv(now)
        return self.take_events()  # type: ignore[attr-defined, no-any-return]

    def _forget_worker_kv(self, now: float) -> None:
        """The worker's KV went with it, not only the lost round's: running requests that no in-flight
        round reads are recomputed too (not counted as lost: their round was not lost), and swapped-out
        waiting requests drop their host copies and resume by recompute."""
        for request in list(self._running.values()):
            if request.in_flight_round is None and request.status is RequestStatus.RUNNING:
                self._requeue_lost(request, now)
        for request in self._live.values():
            if request.host_blocks and request.status is RequestStatus.WAITING:
                self._host_free.extend(request.host_blocks)
                request.host_blocks = []
                request.recompute_debt = max(request.recompute_debt, request.num_computed)
                request.num_computed = 0
                self._set_pending(request, len(request.tokens))

    def _requeue_lost(self, request: Request, now: float) -> None:
        """Preempt a running request by recompute because its KV went with the worker."""
        del self._running[request.request_id]
        self.pool.free(reversed(request.block_ids))
        request.block_ids, request.block_table, request.num_registered = [], (), 0
        apply(request, Input.PREEMPT)
        request.usage.preemptions += 1
        self._preemptions += 1
        request.recompute_debt = max(request.recompute_debt, request.num_computed)
        request.num_computed = 0
        apply(request, Input.REQUEUE)
        self._enqueue(request)
        self._event(request, Stage.PREEMPTED, now, (("mode", "recompute"), ("cause", "worker_lost")))

    def on_worker_restarted(self, now: float) -> CoreEvents:
        """The worker is back empty (restarted); return the drained outbox.

        Running requests that no in-flight round reads are recomputed (PREEMPTED, cause
        "worker_lost"), swapped-out waiting requests drop their host copies, and the prefix cache
        forgets every hash (ALL_CLEARED; only free cached blocks are released). After
        `on_round_lost` this is only the cache reset; it matters when the worker was found dead
        between rounds, with no round lost.
        """
        self._forget_worker_kv(now)
        self.pool.reset_cache()
        return self.take_events()  # type: ignore[attr-defined, no-any-return]

    def _fail_round(self, record: InFlightRound, error: str, now: float) -> None:
        """A round that failed as a whole fails every request it carried (exactly once)."""
        for request, _, _, _ in record.entries:
            request.in_flight_round = None
            if request.status is RequestStatus.RUNNING:
                self._end_running(request, Input.FAIL, now, f"round {record.round_id} failed: {error}")
            else:
                self._release_deferred(request, now)
        self._finish_swaps(record, now, copied=False)
        self._host_free.extend(record.host_release)

    # ---- terminations ----------------------------------------------------------------------
    def cancel(self, request_id: str, now: float) -> RequestStatus | None:
        """Cancel a request and return its status afterwards (None for an unknown id).

        Waiting or idle requests end at once; one read by an in-flight round is CANCELLING
        until that round's result arrives. Cancelling again, or a finished request, changes nothing.
        """
        request = self._live.get(request_id)
        if request is None:
            return self._terminal.get(request_id)
        if request.status is RequestStatus.CANCELLING:
            return request.status
        self._event(request, Stage.CANCEL_REQUESTED, now)
        return self._terminate(request, Input.CANCEL, Input.CANCEL_DEFERRED, now)

    def expire(self, now: float) -> list[str]:
        """Time out every request whose queue or total deadline is <= now; return their ids."""
        heap = self._deadlines
        expired: list[str] = []
        while heap and heap[0][0] <= now:
            _, _, kind, request = heapq.heappop(heap)
            if not self._deadline_live(kind, request):
                continue
            self._terminate(request, Input.TIMEOUT, Input.TIMEOUT_DEFERRED, now)
            expired.append(request.request_id)
        return expired

    def next_deadline(self) -> float | None:
        """Return the earliest pending queue or total deadline, or None when there is none."""
        heap = self._deadlines
        while heap and not self._deadline_live(heap[0][2], heap[0][3]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _deadline_live(self, kind: int, request: Request) -> bool:
        if self._live.get(request.request_id) is not request:
            return False
        if request.status is RequestStatus.CANCELLING:
            return False
        return kind == _TOTAL_DEADLINE or request.first_scheduled_time is None

    def _terminate(self, request: Request, now_input: Input, deferred: Input, now: float) -> RequestStatus:
        if request.in_flight_round is not None:
            self._running.pop(request.request_id, None)
            self._swapping.pop(request.request_id, None)
            apply(request, deferred)
            self._set_pending(request, 0)
            is_cancel = deferred is Input.CANCEL_DEFERRED
            request.release_input = Input.RELEASE_CANCELLED if is_cancel else Input.RELEASE_TIMED_OUT
            self._cancelling[request.request_id] = request
            return request.status
        if request.status is RequestStatus.WAITING:
            self._dequeue(request)
        else:
            self._running.pop(request.request_id, None)
        self._end(request, now_input, now)
        return request.status

    def _release_deferred(self, request: Request, now: float) -> None:
        del self._cancelling[request.request_id]
        self._end(request, request.release_input, now)  # type: ignore[arg-type]

    def _end_running(self, request: Request, event: Input, now: float, detail: str = "") -> None:
        del self._running[request.request_id]
        self._end(request, event, now, detail)

    def _end(self, request: Request, event: Input, now: float, detail: str = "") -> None:
        """Enter a terminal status, release blocks and emit the Finished record (exactly once)."""
        status = apply(request, event)
        if request.pending_prefill:
            self._set_pending(request, 0)
        released = self._release_blocks(request)
        del self._live[request.request_id]
        if self._account is not None:  # type: ignore[attr-defined]
            self._queue.on_live(request.tenant, -1)
        self._remember(request.request_id, status)
        self._counts[status] = self._counts.get(status, 0) + 1
        usage = request.usage
        usage.output_tokens = request.num_outputs
        self._outbox.finished.append(
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
        self._event(request, Stage.FINISHED, now, (("status", status.value),))
        if released:
            self._event(request, Stage.KV_RELEASED, now)

    def _release_blocks(self, request: Request) -> bool:
        released = bool(request.block_ids or request.host_blocks)
        if request.block_ids:
            self.pool.free(reversed(request.block_ids))
            request.block_ids = []
            request.block_table = ()
        if request.host_blocks:
            self._host_free.extend(request.host_blocks)
            request.host_blocks = []
        return released

    def _remember(self, request_id: str, status: RequestStatus) -> None:
        terminal = self._terminal
        terminal[request_id] = status
        if len(terminal) > TERMINAL_MEMORY:
            terminal.popitem(last=False)

    # ---- queue and outbox ------------------------------------------------------------------
    def _enqueue(self, request: Request, cached_tokens: int = 0) -> None:
        """Queue `request`; its pending prefill is what is not computed, less `cached_tokens`."""
        self._queue.push(request)
        self._set_pending(request, len(request.tokens) - request.num_computed - cached_tokens)

    def _dequeue(self, request: Request, served: bool = False) -> None:
        """Take `request` out of the queue; `served` when it is the head being scheduled.

        A served request keeps its pending prefill: it is work this replica still has to do,
        and `_place` takes it off chunk by chunk.
        """
        if served:
            head = self._queue.pop()
            assert head is request, "only the head of the queue is scheduled"
        else:
            self._queue.remove(request)
            self._set_pending(request, 0)

    def _set_pending(self, request: Request, tokens: int) -> None:
        # One counter for the whole replica, moved by each request's delta: stats() stays O(1).
        self._queued_prefill_tokens += tokens - request.pending_prefill
        request.pending_prefill = tokens

    def _event(
        self, request: Request, stage: Stage, now: float, detail: tuple[tuple[str, int | str], ...] = ()
    ) -> None:
        self._outbox.lifecycle.append(LifecycleEvent(request.request_id, stage, now, detail))

    def _drop(self, count: int) -> None:
        if count > 0:
            self._outbox.dropped_results += count
            self._dropped_total += count
