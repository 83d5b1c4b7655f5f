"""What a round's answer does: tokens appended, blocks registered, requests finished or requeued.

`RoundOutcomes` keeps the record of every planned round until its result arrives (`in_flight`)
and applies the result, or the loss of the round with the worker. Readers are tracked per
request, not per block: a request placed in a round gets `in_flight_round` set, and its blocks
stay referenced until that round's result arrives, even if the request was cancelled or timed out
meanwhile (it waits in CANCELLING and `Endings` releases it here). A swap-out victim's device
blocks are pinned in the pool for the same duration.

Two rounds in flight (overlap scheduling): a request placed ahead is read by two rounds
(`in_flight_prev`, then `in_flight_round`); it is released only when the later one answers. A
request that ends while the later round still reads it (a stop token, a failure) keeps its blocks
pinned (`held_blocks`) until then, and that round's output for it is dropped and counted. Results
must arrive in plan order; a lost round takes every later in-flight round with it (the worker runs
them in order, so none of them ran either).

A result that refuses some sequences (`RoundResult.refused`: they did not fit the worker, the rest of
the round ran) fails exactly those requests, with the refusal as detail; the other entries pair with
the outputs as usual. A refused request a later round still reads (placed ahead) keeps its blocks
pinned until that round answers, like any request that ends mid-flight; the worker drops its pending
decode there, and any output for it is dropped.
"""

from __future__ import annotations

from array import array
from typing import Any

from scheduler_svc.core.parts import CoreParts
from scheduler_svc.core.request import Request, block_hashes_upto
from scheduler_svc.core.round import DECODE, InFlightRound
from scheduler_svc.core.state import Input, apply
from sluice.types import RefusedSeq, RequestStatus, RoundResult, SeqOutput, Stage


def _in_plan_order(entries: list[Request], outputs: tuple[SeqOutput, ...]) -> bool:
    """Return whether output i is for entry i, for every i (the worker's usual answer).

    Compiled, an indexed loop that reads each output's id once and compares the two strings (identity
    first): a third of the instructions per sequence of the C-level `all(map(eq, map(attrgetter(...))))`
    it replaces, which goes through an iterator and a call per item (callgrind, 256 running)."""
    # mypyc turns all() of a generator into that loop (no generator object).
    return len(outputs) == len(entries) and all(
        outputs[i].request_id == entries[i].request_id for i in range(len(entries)))


class RoundOutcomes:
    """In-flight rounds of one core and what their results (or their loss) do."""

    __slots__ = ("in_flight", "_table", "_backlog", "_pool", "_host", "_outbox", "_endings",
                 "_block_size", "_max_lost_rounds", "_event_token_ids")

    def __init__(self, parts: CoreParts) -> None:
        self.in_flight: dict[int, InFlightRound] = {}
        """Record of each planned round by id until its result arrives or it is lost."""
        config = parts.config
        self._table = parts.table
        self._backlog = parts.backlog
        self._pool = parts.pool
        self._host = parts.host
        self._outbox = parts.outbox
        self._endings = parts.endings
        self._block_size = config.block_size
        self._max_lost_rounds = config.max_lost_rounds
        self._event_token_ids = config.kv_event_token_ids

    # ---- readers ---------------------------------------------------------------------------
    @staticmethod
    def _unread(request: Request, round_id: int) -> bool:
        """Round `round_id` no longer reads `request`; return True when no in-flight round does."""
        if request.in_flight_prev == round_id:
            request.in_flight_prev = None
            return False
        if request.in_flight_round == round_id:
            request.in_flight_round = None
        return request.in_flight_round is None

    def _release_unread(self, request: Request, now: float) -> None:
        """A request that is not running and no round reads any more: release what waited for the round."""
        if request.status is RequestStatus.CANCELLING:
            self._endings.release_deferred(request, now)
        elif request.held_blocks:
            self._pool.unpin(reversed(request.held_blocks))
            request.held_blocks = ()

    # ---- results ---------------------------------------------------------------------------
    def on_round_result(self, result: RoundResult, now: float) -> None:
        """Apply a worker's result for a planned round.

        Outputs for unknown rounds, requests that are gone or cancelling, or older epochs are
        dropped and counted (`dropped_results`); they never resurrect a request.
        """
        record = self.in_flight.pop(result.round_id, None)
        if record is None:
            self._outbox.drop(len(result.outputs))
        elif result.error:
            self._outbox.drop(sum(1 for out in result.outputs if out.token_ids))
            self._fail_round(record, result.error, now)
        else:
            entries = self._refuse(record, result.refused, now) if result.refused else record.entries
            self._apply_outputs(record, entries, result.outputs, now)
            if record.swapping:
                self._finish_swaps(record, now)
            if record.host_written or record.host_read:
                self._host.confirm(record.host_written)
                self._host.unread(record.host_read)
            for request in record.loading:  # copied in: they compute from the next round
                request.loading = False
                if self._unread(request, record.round_id) and request.status is not RequestStatus.RUNNING:
                    self._release_unread(request, now)

    def _refuse(self, record: InFlightRound, refused: tuple[RefusedSeq, ...], now: float) -> list[Request]:
        """Fail the requests whose sequence the worker refused (exactly once); return the round's other entries."""
        why = {seq.request_id: seq for seq in refused}
        kept: list[Request] = []
        for request in record.entries:
            seq = why.get(request.request_id)
            if seq is None:
                kept.append(request)
                continue
            unread = self._unread(request, record.round_id)
            if request.status is RequestStatus.RUNNING:
                detail = f"round {record.round_id} refused its sequence: {seq.detail}"
                self._endings.end_running(request, Input.FAIL, now, detail)
            elif unread:
                self._release_unread(request, now)
        return kept

    def _apply_outputs(self, record: InFlightRound, entries: list[Request], outputs: tuple[SeqOutput, ...],
                       now: float) -> None:
        # The worker answers one output per sequence in plan order: then the outputs pair up by
        # position; else they are matched by id.
        matched: tuple[SeqOutput | None, ...]
        if _in_plan_order(entries, outputs):
            matched, unmatched = outputs, 0
        else:
            matched, unmatched = self._match_outputs(entries, outputs)
        # Locals for what every entry uses: compiled, a module global or a bound method is a lookup per use.
        outbox = self._outbox
        drop = outbox.drop
        emitted = outbox.events.tokens
        append_token = array.append
        block_size = self._block_size
        caching = self._pool.caching
        account = self._backlog.account
        running = RequestStatus.RUNNING
        chunks = record.chunks
        round_id = record.round_id
        for i in range(len(entries)):
            request = entries[i]
            out = matched[i]
            if chunks is None:
                num_tokens, sample = 1, True  # DECODE, without a global and a tuple per entry
            else:
                num_tokens, sample = chunks.get(request, DECODE)
            # _unread's two common cases inlined: read by this round only, or placed ahead in the next.
            prev = request.in_flight_prev
            if prev is None:
                request.in_flight_round = None
                unread = True
            elif prev == round_id:
                request.in_flight_prev = None
                unread = False
            else:
                unread = self._unread(request, round_id)
            if request.lost_rounds:
                request.lost_rounds = 0
            if request.status is not running:
                if out is not None and out.token_ids:
                    drop(1)
                if unread:
                    self._release_unread(request, now)
                continue
            computed = request.num_computed = request.num_computed + num_tokens
            if caching and computed // block_size > request.num_registered:
                self._register_full_blocks(request)
            if not sample:
                if out is not None and out.token_ids:
                    drop(1)
            elif out is None or out.epoch != request.epoch or not (token_ids := out.token_ids):
                if out is not None:
                    drop(1)
                detail = f"round {round_id} returned no token for epoch {request.epoch}"
                self._endings.end_running(request, Input.FAIL, now, detail)
            else:
                # Kept as the worker's int object (Any): typed int, compiled code would unbox it and box
                # it again for the append and for the event, two new ints per token.
                token: Any = token_ids[0]
                tokens = request.tokens
                index = len(tokens) - request.num_prompt
                append_token(tokens, token)
                request.last_token_ids = token_ids
                emitted.append((request.request_id, index, token))
                # One test for the common case; the rare ones (first token, finish, fair-share
                # accounting, extra tokens, token ids not in a tuple) are sorted out in _after_token.
                if (
                    index == 0
                    or index + 1 >= request.max_tokens
                    or token == request.eos_token_id
                    or out.stop_string_hit
                    or len(token_ids) != 1
                    or type(token_ids) is not tuple  # a primitive when compiled; __class__ is a lookup
                    or account is not None
                    or (request.stop_token_ids and token in request.stop_token_ids)
                    or out.logprobs is not None
                ):
                    self._after_token(request, out, index, token, now)
        if unmatched:
            drop(unmatched)
        if record.host_release:
            self._host.release(record.host_release)

    def _match_outputs(
        self, entries: list[Request], outputs: tuple[SeqOutput, ...]
    ) -> tuple[tuple[SeqOutput | None, ...], int]:
        """Return (each entry's output by id, or None, in entry order; how many outputs match no entry).

        Of outputs repeating an id, the newest epoch is kept (the others are counted as dropped).
        """
        by_id = {out.request_id: out for out in outputs}
        if len(by_id) != len(outputs):
            by_id = self._newest_outputs(outputs)
        pop = by_id.pop
        return tuple([pop(request.request_id, None) for request in entries]), len(by_id)

    def _newest_outputs(self, outputs: tuple[SeqOutput, ...]) -> dict[str, SeqOutput]:
        """Keep one output per request (the newest epoch); count the others as dropped."""
        by_id: dict[str, SeqOutput] = {}
        for out in outputs:
            kept = by_id.get(out.request_id)
            if kept is not None:
                self._outbox.drop(1)
                if kept.epoch >= out.epoch:
                    continue
            by_id[out.request_id] = out
        return by_id

    def _after_token(self, request: Request, out: SeqOutput, index: int, token: int, now: float) -> None:
        """Everything but the append for output token `index`: first token, accounting, finishing."""
        if len(out.token_ids) > 1:
            self._outbox.drop(len(out.token_ids) - 1)
        if len(out.token_ids) != 1 or type(out.token_ids) is not tuple:
            request.last_token_ids = (token,)  # only the first token was taken
        if out.logprobs is not None:
            self._outbox.events.logprobs[(request.request_id, index)] = out.logprobs
        if index == 0:
            request.first_token_time = now
            self._outbox.event(request, Stage.FIRST_TOKEN, now)
        account = self._backlog.account
        if account is not None:
            account(request.tenant, 0, 1)
        if token == request.eos_token_id or token in request.stop_token_ids or out.stop_string_hit:
            self._endings.end_running(request, Input.STOP, now)
        elif index + 1 >= request.max_tokens:
            self._endings.end_running(request, Input.LENGTH, now)

    def _register_full_blocks(self, request: Request) -> None:
        """Register the hash of each block that became full and computed (STORED events)."""
        full = request.num_computed // self._block_size
        hashes = block_hashes_upto(request, full, self._block_size, request.salt)
        pool = self._pool  # `pool.register(...)`, not a bound method in a local: compiled, a native call without argument parsing
        if self._event_token_ids:
            size, tokens = self._block_size, request.tokens
            for index in range(request.num_registered, full):
                pool.register(request.block_ids[index], hashes[index], hashes[index - 1] if index else 0,
                              tokens[index * size : (index + 1) * size])
        else:
            for index in range(request.num_registered, full):
                pool.register(request.block_ids[index], hashes[index], hashes[index - 1] if index else 0)
        request.num_registered = full

    def _finish_swaps(self, record: InFlightRound, now: float, copied: bool = True) -> None:
        """Unpin swap-out victims' device blocks and re-queue them (or release cancelled ones).

        When the round failed, the host copies cannot be trusted: the victim drops them and
        resumes by recompute instead.
        """
        for victim in record.swapping:
            self._pool.unpin(reversed(victim.swap_pinned))
            victim.swap_pinned = ()
            victim.in_flight_round = None
            if victim.status is RequestStatus.CANCELLING:
                self._endings.release_deferred(victim, now)
                continue
            if copied:
                self._host.stored(victim.host_blocks)
            else:
                self._host.release(victim.host_blocks)
                victim.host_blocks = ()
                victim.recompute_debt = max(victim.recompute_debt, victim.num_computed)
                victim.num_computed = 0
            del self._table.swapping[victim.request_id]
            apply(victim, Input.REQUEUE)
            self._backlog.enqueue(victim)

    def _fail_round(self, record: InFlightRound, error: str, now: float) -> None:
        """A round that failed as a whole fails every request it carried (exactly once), the ones it copied in too."""
        for request in record.loading:
            request.loading = False
        for request in (*record.entries, *record.loading):
            unread = self._unread(request, record.round_id)
            if request.status is RequestStatus.RUNNING:
                self._endings.end_running(request, Input.FAIL, now, f"round {record.round_id} failed: {error}")
            elif unread:
                self._release_unread(request, now)
        self._finish_swaps(record, now, copied=False)
        self._host.release(record.host_release)
        self._host.drop(record.host_written)
        self._host.unread(record.host_read)

    # ---- a worker lost ---------------------------------------------------------------------
    def on_round_lost(self, round_id: int, now: float) -> None:
        """The worker went away with round `round_id` in flight (see SchedulerCore.on_round_lost); every
        later in-flight round is lost with it."""
        if round_id not in self.in_flight:
            return
        for later in sorted(r for r in self.in_flight if r >= round_id):
            self._lose(self.in_flight.pop(later), now)
        self.forget_worker_kv(now)

    def _lose(self, record: InFlightRound, now: float) -> None:
        round_id, limit = record.round_id, self._max_lost_rounds
        for request in record.loading:
            request.loading = False
        for request in (*record.entries, *record.loading):
            if not self._unread(request, round_id):
                continue  # a later round reads it too: that round's loss handles it
            if request.status is not RequestStatus.RUNNING:
                self._release_unread(request, now)
                continue
            request.lost_rounds += 1
            if request.lost_rounds > limit:
                detail = (f"round {round_id} lost with the worker; the request was lost in "
                          f"{request.lost_rounds} consecutive rounds (max_lost_rounds {limit})")
                self._endings.end_running(request, Input.FAIL, now, detail)
            else:
                self._requeue_lost(request, now)
        self._finish_swaps(record, now, copied=False)
        self._host.release(record.host_release)
        self._host.drop(record.host_written)
        self._host.unread(record.host_read)

    def forget_worker_kv(self, now: float) -> None:
        """The worker's KV went with it, not only the lost round's: running requests that no in-flight
        round reads are recomputed too (not counted as lost: their round was not lost), and swapped-out
        waiting requests drop their host copies and resume by recompute."""
        for request in list(self._table.running.values()):
            if request.in_flight_round is None and request.status is RequestStatus.RUNNING:
                self._requeue_lost(request, now)
        for request in self._table.live.values():
            if request.host_blocks and request.status is RequestStatus.WAITING:
                self._host.release(request.host_blocks)
                request.host_blocks = ()
                request.recompute_debt = max(request.recompute_debt, request.num_computed)
                request.num_computed = 0
                self._backlog.set_pending(request, len(request.tokens))

    def _requeue_lost(self, request: Request, now: float) -> None:
        """Preempt a running request by recompute because its KV went with the worker."""
        del self._table.running[request.request_id]
        if request.loads:  # host-tier hits not copied in yet: the host tier may drop them again
            self._host.unread(copy.src for copy in request.loads)
            request.loads = ()
        self._pool.free(reversed(request.block_ids))
        request.block_ids, request.block_table, request.num_registered = array("q"), (), 0
        apply(request, Input.PREEMPT)
        request.usage.preemptions += 1
        self._outbox.preemptions += 1
        request.recompute_debt = max(request.recompute_debt, request.num_computed)
        request.num_computed = 0
        apply(request, Input.REQUEUE)
        self._backlog.enqueue(request)
        self._outbox.event(request, Stage.PREEMPTED, now, (("mode", "recompute"), ("cause", "worker_lost")))
