"""SchedulerCore: one replica's sans-I/O scheduler (submit, rounds, preemption; results in outcomes.py).

A round is built in phases:
  1. `_schedule_running`: requests already running (decodes and unfinished prefill chunks) in the
     order they started, skipping any still in an in-flight round; a block boundary needs one new
     block, and when none is left `_preempt` frees a victim's (lowest priority, then latest arrival).
  2. `_schedule_waiting`: waiting and resumed requests in policy order, within what is left of the
     query-token, sequence and KV-read budgets, stopping at the first head that does not fit
     (head-of-line blocking is the policies' semantics). Skipped in a round that had to preempt.
  3. `_seal`: the plan, its budget report and the in-flight record.
Cost grows with the round's work: nothing scans the waiting queue, and a decode touches its block
table only when it crosses a block boundary.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import PreemptionMode, SchedulerConfig
from scheduler_svc.core.outcomes import _QUEUE_DEADLINE, _TOTAL_DEADLINE, _Outcomes
from scheduler_svc.core.policies import make_queue
from scheduler_svc.core.request import Request
from scheduler_svc.core.round import RoundBuilder, new_round_budget, new_round_plan, new_scheduled_seq
from scheduler_svc.core.state import Input, apply
from sluice.core_errors import RequestRejected
from sluice.hashing import salt_of
from sluice.types import (
    BlockCopy,
    CoreEvents,
    CoreStats,
    NewRequest,
    RejectReason,
    RequestStatus,
    RoundPlan,
    Stage,
)


class SchedulerCore(_Outcomes):
    """The scheduler of one replica: requests in, round plans and events out. Time is an argument."""

    def __init__(self, config: SchedulerConfig, replica_id: str = "r0") -> None:
        if config.block_size < 1 or config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if config.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {config.max_prefill_chunk}")
        self.config = config
        self.replica_id = replica_id
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self._queue = make_queue(config.policy, config)
        self._account = self._queue.on_service if self._queue.tracks_service else None
        self._swap = config.preemption_mode is PreemptionMode.SWAP
        self._live = {}
        self._running = {}
        self._swapping = {}
        self._cancelling = {}
        self._in_flight = {}
        self._host_free = list(range(config.num_host_blocks - 1, -1, -1))
        self._deadlines = []
        self._deadlines_compact_at = 1024
        self._terminal = OrderedDict()
        self._outbox = CoreEvents()
        self._counts = {}
        self._dropped_total = 0
        self._queued_prefill_tokens = 0
        self._salt = salt_of(config.model_id, config.adapter_version)
        self._block_size = config.block_size
        self._next_round_id = 1
        self._next_arrival_seq = 0
        self._rounds = 0
        self._preemptions = 0
        self._recomputed_tokens = 0
        self._prefix_hit_tokens = 0
        self._prefix_query_tokens = 0

    # ---- submission ------------------------------------------------------------------------
    def submit(self, request: NewRequest, now: float) -> None:
        """Queue a new request. Raises RequestRejected (and changes nothing) when it is refused."""
        self._check_admissible(request)
        try:
            live = Request(request, self._next_arrival_seq + 1)
        except (OverflowError, TypeError) as error:
            raise RequestRejected(
                request.request_id, RejectReason.INVALID, f"token ids must be 64-bit integers: {error}"
            ) from None
        self._next_arrival_seq += 1
        self._live[live.request_id] = live
        if self._account is not None:
            self._queue.on_live(live.tenant, 1)
            if request.tenant_weight is not None:
                self._queue.set_tenant_weight(live.tenant, request.tenant_weight)
        self._enqueue(live, self._cached_prefix_tokens(live))
        if request.queue_deadline is not None:
            self._push_deadline(request.queue_deadline, _QUEUE_DEADLINE, live)
        if request.deadline is not None:
            self._push_deadline(request.deadline, _TOTAL_DEADLINE, live)
        self._event(live, Stage.ENQUEUED, now)

    def _check_admissible(self, request: NewRequest) -> None:
        config = self.config
        if request.tenant_weight is not None and not (request.tenant_weight > 0 and math.isfinite(request.tenant_weight)):
            raise RequestRejected(request.request_id, RejectReason.INVALID,
                                  f"tenant_weight must be a positive finite number, got {request.tenant_weight}")
        rid = request.request_id

        def reject(reason: RejectReason, detail: str) -> RequestRejected:
            return RequestRejected(rid, reason, detail)

        if rid in self._live:
            raise reject(RejectReason.DUPLICATE, "a live request already has this id")
        prompt_len, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
        if prompt_len == 0:
            raise reject(RejectReason.INVALID, "empty prompt")
        if max_tokens < 1:
            raise reject(RejectReason.INVALID, f"max_tokens must be >= 1, got {max_tokens}")
        total = prompt_len + max_tokens
        if total > config.max_model_len:
            raise reject(
                RejectReason.INVALID,
                f"prompt {prompt_len} + max_tokens {max_tokens} = {total} > max_model_len {config.max_model_len}",
            )
        blocks = -(-total // config.block_size)
        if blocks > config.num_blocks:
            raise reject(
                RejectReason.NEVER_FITS,
                f"prompt {prompt_len} + max_tokens {max_tokens} needs {blocks} blocks of "
                f"{config.block_size} tokens, the replica has {config.num_blocks}",
            )
        if config.max_kv_read_tokens is not None and total > config.max_kv_read_tokens:
            raise reject(
                RejectReason.NEVER_FITS,
                f"prompt {prompt_len} + max_tokens {max_tokens} = {total} > max_kv_read_tokens "
                f"{config.max_kv_read_tokens}: its decodes could never run",
            )
        if len(self._queue) >= config.max_waiting:
            raise reject(RejectReason.QUEUE_FULL, f"{len(self._queue)} waiting, max_waiting {config.max_waiting}")

    def _cached_prefix_tokens(self, request: Request) -> int:
        """Return the prompt tokens the prefix cache holds now (an estimate until it is admitted).

        Why: the pending prefill a replica reports should not count work its cache already did;
        the hashes are kept on the request, so admission does not compute them again.
        """
        if not self.pool.caching:
            return 0
        size = self._block_size
        return len(self.pool.lookup(self._hashes_upto(request, (len(request.tokens) - 1) // size))) * size

    def _push_deadline(self, when: float, kind: int, request: Request) -> None:
        heap = self._deadlines
        if len(heap) >= self._deadlines_compact_at:
            # Lazy deletion leaves entries of ended requests behind; drop them in O(n) once the
            # heap has doubled, so the amortised cost per submission stays O(log n).
            heap[:] = [entry for entry in heap if self._deadline_live(entry[2], entry[3])]
            heapq.heapify(heap)
            self._deadlines_compact_at = max(1024, 2 * len(heap))
        heapq.heappush(heap, (when, request.arrival_seq * 2 + kind, kind, request))

    # ---- rounds ----------------------------------------------------------------------------
    def schedule(self, now: float) -> RoundPlan:
        """Build the next round; return its plan (possibly empty: `plan.is_empty`).

        Requests in a round that is still in flight are skipped. A non-empty plan must be
        answered with `on_round_result` carrying its `round_id`.
        """
        round_id = self._next_round_id
        self._next_round_id += 1
        rnd = RoundBuilder(round_id, self.config)
        # The phase calls are skipped when they have nothing to look at: most rounds of a lightly
        # loaded replica carry a few decodes and no queue, and the calls are most of their cost.
        if self._running:
            self._schedule_running(rnd, now)
        if len(self._queue) and not rnd.preempted:
            self._schedule_waiting(rnd, now)
        return self._seal(rnd, now)

    def _schedule_running(self, rnd: RoundBuilder, now: float) -> None:
        """Place running requests in start order; plain decodes take an inlined fast path.

        A plain decode (one known token beyond the computed prefix, no block boundary, no stop
        strings, no pending prefill left by a recompute resume) only appends to the round, so it
        works on local copies of the budgets; anything else syncs them back to `rnd` and goes
        through `_grow` / `_place`.
        """
        max_chunk, block_size = self.config.max_prefill_chunk, self._block_size
        running_status = RequestStatus.RUNNING
        seqs, entries, round_id = rnd.seqs, rnd.entries, rnd.round_id
        tokens_left, seqs_left, kv_left, decodes = rnd.tokens_left, rnd.seqs_left, rnd.kv_left, 0
        for request in list(self._running.values()):
            if request.in_flight_round is not None or request.status is not running_status:
                continue
            if not seqs_left or not tokens_left:
                break
            start = request.num_computed
            tokens = request.tokens
            if (
                len(tokens) - start == 1
                and start >= request.num_prompt
                and len(request.block_ids) * block_size > start
                and not request.stop_tail
                and not request.pending_prefill
            ):
                if kv_left <= start:
                    break
                seqs.append(
                    new_scheduled_seq(
                        request.request_id,
                        request.epoch,
                        (tokens[start],),
                        start,
                        request.block_table,
                        request.sampling,
                        True,
                        start + 1 - request.num_prompt,
                        (),
                    )
                )
                entries.append((request, 1, True, True))
                request.in_flight_round = round_id
                tokens_left, seqs_left, kv_left, decodes = tokens_left - 1, seqs_left - 1, kv_left - start - 1, decodes + 1
                continue
            rnd.tokens_left, rnd.seqs_left, rnd.kv_left = tokens_left, seqs_left, kv_left
            rnd.decode_tokens, decodes = rnd.decode_tokens + decodes, 0
            num = min(len(tokens) - start, max_chunk, tokens_left, kv_left - start)
            if num <= 0:
                break
            if len(request.block_ids) * block_size >= start + num or self._grow(request, start + num, rnd, now):
                self._place(request, start, num, rnd, now)
            tokens_left, seqs_left, kv_left = rnd.tokens_left, rnd.seqs_left, rnd.kv_left
        rnd.tokens_left, rnd.seqs_left, rnd.kv_left = tokens_left, seqs_left, kv_left
        rnd.decode_tokens += decodes

    def _grow(self, request: Request, end: int, rnd: RoundBuilder, now: float) -> bool:
        """Give `request` blocks up to position `end`, preempting others; False if it was preempted."""
        need = -(-end // self._block_size) - len(request.block_ids)
        while True:
            blocks = self.pool.allocate(need)
            if blocks is not None:
                request.block_ids.extend(blocks)
                request.block_table = tuple(request.block_ids)
                return True
            victim = self._pick_victim(request, rnd.round_id)
            self._preempt(victim, rnd, now)
            if victim is request:
                return False

    def _pick_victim(self, needy: Request, round_id: int) -> Request:
        """Return the request to preempt so that `needy` can grow: lowest priority, then latest arrival.

        Candidates are the running requests not read by an in-flight round (ones placed in this
        round are taken back out) plus `needy` itself, which is chosen only when it ranks lowest:
        a request never preempts one that ranks above it.
        """
        victim = needy
        victim_rank = (needy.priority, -needy.arrival_time, -needy.arrival_seq)
        for request in self._running.values():
            if request.in_flight_round not in (None, round_id) or request is needy:
                continue
            rank = (request.priority, -request.arrival_time, -request.arrival_seq)
            if rank < victim_rank:
                victim, victim_rank = request, rank
        return victim

    def _preempt(self, victim: Request, rnd: RoundBuilder, now: float) -> None:
        """Take `victim` off the device: swap its blocks to host if there is room, else recompute."""
        rnd.preempted = True
        if victim.in_flight_round == rnd.round_id:
            self._unplace(victim, rnd)
        del self._running[victim.request_id]
        blocks = victim.block_ids
        # Only blocks with computed KV are worth copying (one grown earlier in this round is not).
        computed = -(-victim.num_computed // self._block_size)
        swap = self._swap and len(self._host_free) >= computed
        if swap and computed < len(blocks):
            self.pool.free(reversed(blocks[computed:]))
            blocks = blocks[:computed]
        victim.block_ids, victim.block_table, victim.num_registered = [], (), 0
        apply(victim, Input.PREEMPT)
        victim.usage.preemptions += 1
        self._preemptions += 1
        if swap:
            host = [self._host_free.pop() for _ in blocks]
            rnd.swap_out += tuple(BlockCopy(d, h) for d, h in zip(blocks, host, strict=True))
            # Pinned until the copy is done: the worker reads them before this round's forward.
            self.pool.pin(blocks)
            self.pool.free(reversed(blocks))
            victim.swap_pinned, victim.host_blocks = blocks, host
            victim.in_flight_round = rnd.round_id
            rnd.swapping += (victim,)
            self._swapping[victim.request_id] = victim
        else:
            self.pool.free(reversed(blocks))
            victim.recompute_debt = max(victim.recompute_debt, victim.num_computed)
            victim.num_computed = 0
            apply(victim, Input.REQUEUE)
            self._enqueue(victim)
        self._event(victim, Stage.PREEMPTED, now, (("mode", "swap" if swap else "recompute"),))

    def _schedule_waiting(self, rnd: RoundBuilder, now: float) -> None:
        queue = self._queue
        while rnd.seqs_left and rnd.tokens_left:
            request = queue.peek()
            if request is None:
                return
            admitted = self._resume_swapped(request, rnd, now) if request.host_blocks else self._admit(request, rnd, now)
            if not admitted:
                return

    def _admit(self, request: Request, rnd: RoundBuilder, now: float) -> bool:
        """Place the head of the queue (first schedule or recompute resume) if it fits."""
        size, pool = self._block_size, self.pool
        hits: list[int] = []
        if pool.caching:
            hits = pool.lookup(self._hashes_upto(request, (len(request.tokens) - 1) // size))
        start = len(hits) * size
        num = min(len(request.tokens) - start, self.config.max_prefill_chunk, rnd.tokens_left, rnd.kv_left - start)
        need = -(-(start + num) // size) - len(hits)
        if num <= 0 or need + pool.count_unreferenced(hits) > pool.num_allocatable:
            return False
        self._dequeue(request, served=True)
        pool.acquire(hits)
        request.block_ids = hits + (pool.allocate(need) or [])
        request.block_table = tuple(request.block_ids)
        request.num_registered = len(hits)
        request.num_computed = start
        self._set_pending(request, len(request.tokens) - start)  # cached blocks are no work
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.usage.cached_tokens = start
            self._prefix_hit_tokens += start
            self._prefix_query_tokens += len(request.tokens)
            self._event(request, Stage.FIRST_SCHEDULED, now, (("cached_tokens", start),))
        else:
            recomputed = max(0, request.recompute_debt - start)
            request.recompute_debt = 0
            request.usage.recomputed_tokens += recomputed
            self._recomputed_tokens += recomputed
            self._event(request, Stage.RESUMED, now, (("mode", "recompute"), ("cached_tokens", start)))
        self._start_running(request)
        self._place(request, start, num, rnd, now)
        return True

    def _resume_swapped(self, request: Request, rnd: RoundBuilder, now: float) -> bool:
        """Bring a swapped-out request back: device blocks, swap-in copies, then its next chunk."""
        start = request.num_computed
        num = min(len(request.tokens) - start, self.config.max_prefill_chunk, rnd.tokens_left, rnd.kv_left - start)
        need = -(-(start + num) // self._block_size)
        if num <= 0 or need > self.pool.num_allocatable:
            return False
        self._dequeue(request, served=True)
        blocks = self.pool.allocate(need) or []
        rnd.swap_in += tuple(BlockCopy(h, d) for h, d in zip(request.host_blocks, blocks, strict=False))
        # The host copies are read by this round; they are free once its result arrives.
        rnd.host_release += tuple(request.host_blocks)
        request.host_blocks = []
        request.block_ids, request.block_table, request.num_registered = blocks, tuple(blocks), 0
        self._event(request, Stage.RESUMED, now, (("mode", "swap"),))
        self._start_running(request)
        self._place(request, start, num, rnd, now)
        return True

    def _start_running(self, request: Request) -> None:
        apply(request, Input.SCHEDULE)
        self._running[request.request_id] = request

    def _place(self, request: Request, start: int, num: int, rnd: RoundBuilder, now: float) -> None:
        """Add `num` tokens of `request` from position `start` to the round."""
        tokens = request.tokens
        end = start + num
        sample = end == len(tokens)
        num_outputs = len(tokens) - request.num_prompt
        recent = tuple(tokens[max(request.num_prompt, len(tokens) - request.stop_tail) :]) if request.stop_tail else ()
        rnd.seqs.append(
            new_scheduled_seq(
                request.request_id,
                request.epoch,
                tuple(tokens[start:end]),
                start,
                request.block_table,
                request.sampling,
                sample,
                num_outputs,
                recent,
            )
        )
        decode = num == 1 and sample and start >= request.num_prompt
        if request.pending_prefill:
            # A chunk that reaches the last known token ends the prefill (what follows is decode).
            self._set_pending(request, 0 if sample else len(tokens) - end)
        rnd.entries.append((request, num, sample, decode))
        request.in_flight_round = rnd.round_id
        rnd.tokens_left -= num
        rnd.seqs_left -= 1
        rnd.kv_left -= end
        if decode:
            rnd.decode_tokens += 1
        else:
            rnd.prefill_tokens += num

    def _unplace(self, request: Request, rnd: RoundBuilder) -> None:
        """Take a request placed earlier in this round back out (it is being preempted)."""
        entries = rnd.entries
        index = next(i for i in range(len(entries) - 1, -1, -1) if entries[i][0] is request)
        _, num, _, decode = entries.pop(index)
        seq = rnd.seqs.pop(index)
        request.in_flight_round = None
        rnd.tokens_left += num
        rnd.seqs_left += 1
        rnd.kv_left += seq.start_position + num
        if decode:
            rnd.decode_tokens -= 1
        else:
            rnd.prefill_tokens -= num
            self._set_pending(request, len(request.tokens) - seq.start_position)

    def _seal(self, rnd: RoundBuilder, now: float) -> RoundPlan:
        config = self.config
        if rnd.prefill_tokens:
            self._note_prefill_chunks(rnd, now)
        # Positional, in RoundBudget's field order (new_round_budget writes the slots directly).
        budget = new_round_budget(
            config.max_num_batched_tokens,
            config.max_num_batched_tokens - rnd.tokens_left,
            config.max_num_seqs,
            config.max_num_seqs - rnd.seqs_left,
            config.max_kv_read_tokens,
            (config.max_kv_read_tokens or 1 << 62) - rnd.kv_left,
            rnd.prefill_tokens,
            rnd.decode_tokens,
        )
        swap_out, swap_in = rnd.swap_out, rnd.swap_in
        plan = new_round_plan(rnd.round_id, tuple(rnd.seqs), swap_out, swap_in, budget)
        if rnd.seqs or swap_out or swap_in:
            self._in_flight[rnd.round_id] = rnd
            self._rounds += 1
        return plan

    def _note_prefill_chunks(self, rnd: RoundBuilder, now: float) -> None:
        # Emitted when the round is sealed, so a chunk taken back by a preemption never shows up.
        account = self._account
        for seq, (request, num, _, decode) in zip(rnd.seqs, rnd.entries, strict=True):
            if not decode:
                self._event(request, Stage.PREFILL_CHUNK, now, (("tokens", num), ("start", seq.start_position)))
                if account is not None:
                    account(request.tenant, num, 0)

    # ---- views -----------------------------------------------------------------------------
    def take_events(self) -> CoreEvents:
        """Return everything that happened since the last call and start a new outbox."""
        events, self._outbox = self._outbox, CoreEvents()
        if self.pool.has_events:
            events.kv_events.extend(self.pool.take_events())
        return events

    def stats(self) -> CoreStats:
        """Return counters and ledger sizes (O(1))."""
        pool, counts = self.pool, self._counts
        return CoreStats(
            waiting=len(self._queue),
            running=len(self._running),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_blocks_cached=pool.num_cached,
            host_blocks_total=self.config.num_host_blocks,
            host_blocks_used=self.config.num_host_blocks - len(self._host_free),
            preemptions=self._preemptions,
            recomputed_tokens=self._recomputed_tokens,
            dropped_results=self._dropped_total,
            rounds=self._rounds,
            queued_prefill_tokens=self._queued_prefill_tokens,
            finished=counts.get(RequestStatus.FINISHED_STOP, 0) + counts.get(RequestStatus.FINISHED_LENGTH, 0),
            cancelled=counts.get(RequestStatus.CANCELLED, 0),
            timed_out=counts.get(RequestStatus.TIMED_OUT, 0),
            prefix_hit_tokens=self._prefix_hit_tokens,
            prefix_query_tokens=self._prefix_query_tokens,
        )

    def kv_snapshot(self) -> tuple[int, tuple[int, ...]]:
        """Return (last KV event id, hashes of every cached or stored block)."""
        return self.pool.last_event_id, self.pool.cached_hashes()

    def has_unfinished(self) -> bool:
        """Return True while any request is not terminal."""
        return bool(self._live)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (new and preempted)."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Requests holding device blocks and taking part in rounds."""
        return len(self._running)

    def request_status(self, request_id: str) -> RequestStatus | None:
        """Return a request's status, or None for an id the core does not know (or has forgotten)."""
        request = self._live.get(request_id)
        return request.status if request is not None else self._terminal.get(request_id)
