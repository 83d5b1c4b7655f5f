"""The round builder: continuous batching of one replica's running and waiting requests.

A round is built in phases:
  1. `_schedule_running`: requests already running (decodes and unfinished prefill chunks) in the
     order they started, skipping any still in an in-flight round; a block boundary needs one new
     block, and when none is left `_preempt` frees the victim the victim rule picks. A victim that is
     swapped out frees its device blocks only when its round has run: if the needy request is then the
     rule's only victim left while a swap-out is under way, it keeps its blocks and waits a round for them
     instead of preempting itself. (Preempting itself let two requests that do not fit together throw
     their own work away by turns for ever: each swap freed nothing in time, so the needy one recomputed
     and the swapped one came back in; the stateful test's livelock, 96 preemptions and no end.)
     Decodes first: a prefill chunk leaves one token for each running request after it, and a chunk
     deep into a long prompt pays for its attention out of the token budget (`round.chunk_tokens`).
  2. `_schedule_waiting`: waiting and resumed requests in policy order, within what is left of the
     query-token, sequence and KV-read budgets, stopping at the first head that does not fit
     (head-of-line blocking is the policies' semantics). Skipped in a round that had to preempt.
  With `overlap` (the round is planned while the previous one executes), a running request that the
  previous round samples is placed once more, ahead: one decode of the token that round will sample
  (`PENDING_TOKEN`, filled in by the worker), as if it produced exactly one token (`ahead.place_ahead`);
  one whose in-flight prefill chunk does not sample gets its next chunk of known tokens (`ahead.chunk_ahead`).
  3. `_seal`: the plan, its budget report and the in-flight record (kept by `RoundOutcomes`).
Cost grows with the round's work: nothing scans the waiting queue, and a decode touches its block
table only when it crosses a block boundary.
"""

from __future__ import annotations

from array import array

from scheduler_svc.core.ahead import PENDING, chunk_ahead, place_ahead
from scheduler_svc.core.config import PreemptionMode
from scheduler_svc.core.outcomes import RoundOutcomes
from scheduler_svc.core.parts import CoreParts
from scheduler_svc.core.request import Request, block_hashes_upto
from scheduler_svc.core.round import (
    DECODE,
    RoundBuilder,
    attention_charge,
    chunk_tokens,
    new_round_budget,
    new_round_plan,
    new_scheduled_seq,
)
from scheduler_svc.core.state import Input, apply
from scheduler_svc.core.victims import make_victim_rule
from sluice.types import BlockCopy, RequestStatus, RoundPlan, Stage


class Batcher:
    """Builds each round of one core from its parts; `schedule(now)` returns the plan."""

    __slots__ = ("next_round_id", "_config", "_block_size", "_swap", "_victims", "_table",
                 "_backlog", "_pool", "_host", "_outbox", "_outcomes")

    def __init__(self, parts: CoreParts, outcomes: RoundOutcomes) -> None:
        self.next_round_id = 1
        config = self._config = parts.config
        self._block_size = config.block_size
        self._swap = config.preemption_mode is PreemptionMode.SWAP
        self._victims = make_victim_rule(config.victim_policy)
        self._table = parts.table
        self._backlog = parts.backlog
        self._pool = parts.pool
        self._host = parts.host
        self._outbox = parts.outbox
        self._outcomes = outcomes

    def schedule(self, now: float, overlap: bool = False) -> RoundPlan:
        """Build the next round; return its plan (possibly empty: `plan.is_empty`).

        Requests in a round that is still in flight are skipped, unless `overlap` places them ahead
        (see the module docstring). A non-empty plan must be answered with `on_round_result`
        carrying its `round_id`, in plan order when rounds overlap.
        """
        round_id = self.next_round_id
        self.next_round_id += 1
        rnd = RoundBuilder(round_id, self._config)
        # The phase calls are skipped when they have nothing to look at: most rounds of a lightly
        # loaded replica carry a few decodes and no queue, and the calls are most of their cost.
        if self._table.running:
            self._schedule_running(rnd, now, overlap)
        if self._backlog.queue.length and not rnd.preempted:  # len(backlog), without two calls
            self._schedule_waiting(rnd, now)
        if self._host.prefix_cache and (rnd.seqs or rnd.swap_in):
            self._page_out(rnd)
        return self._seal(rnd, now)

    def _schedule_running(self, rnd: RoundBuilder, now: float, overlap: bool = False) -> None:
        """Place running requests in start order; plain decodes take an inlined fast path.

        A plain decode (one known token beyond the computed prefix, no block boundary, no stop
        strings, no pending prefill left by a recompute resume) only appends to the round, so it
        works on local copies of the budgets; anything else syncs them back to `rnd` and goes
        through `_grow` / `_place`.
        """
        config, block_size = self._config, self._block_size
        running_status = RequestStatus.RUNNING
        seqs, entries, round_id = rnd.seqs, rnd.entries, rnd.round_id
        tokens_left, seqs_left, kv_left, decodes = rnd.tokens_left, rnd.seqs_left, rnd.kv_left, 0
        # Compiled, a module global is a dict lookup per use and an `int | None` attribute stores a boxed int:
        # the constructor and the boxed round id are taken once per round, not once per decode.
        build_seq = new_scheduled_seq
        in_flight: int | None = round_id
        running = list(self._table.running.values())
        last = len(running) - 1
        for index, request in enumerate(running):
            if request.in_flight_round is not None or request.status is not running_status:
                if (not overlap or request.in_flight_prev is not None or not seqs_left or not tokens_left
                        or request.loading):  # a request being copied in computes after its copies answered
                    continue
                tokens = request.tokens
                start = len(tokens)
                if (
                    request.num_computed + 1 == start  # in flight: a one-token chunk that samples (a decode)
                    and request.status is running_status
                    and not request.stop_tail
                    and start + 1 - request.num_prompt < request.max_tokens
                    and len(request.block_table) * block_size > start  # block_table is tuple(block_ids)
                    and kv_left > start
                ):
                    # _place_ahead's common case, inlined like the plain decodes below.
                    seqs.append(build_seq(request.request_id, request.epoch, PENDING, start,
                                          request.block_table, request.sampling, True,
                                          start + 1 - request.num_prompt, (), ()))
                    entries.append(request)
                    request.in_flight_prev = request.in_flight_round
                    request.in_flight_round = in_flight
                    tokens_left -= 1
                    seqs_left -= 1
                    kv_left -= start + 1
                    decodes += 1
                    continue
                rnd.tokens_left, rnd.seqs_left, rnd.kv_left = tokens_left, seqs_left, kv_left
                if place_ahead(request, rnd, self._outcomes.in_flight, self._pool, block_size):
                    tokens_left, seqs_left, kv_left, decodes = tokens_left - 1, seqs_left - 1, rnd.kv_left, decodes + 1
                    continue
                if not request.pending_prefill:  # no prompt left past its in-flight chunk (a decode)
                    continue
                # Decodes first: one token is kept for each running request after this one.
                chunk = chunk_ahead(request, rnd, self._outcomes.in_flight, self._pool, config,
                                    min(last - index, seqs_left - 1))
                if chunk is not None:
                    request.in_flight_prev = request.in_flight_round
                    self._place(request, *chunk, rnd, now)
                    tokens_left, seqs_left, kv_left = rnd.tokens_left, rnd.seqs_left, rnd.kv_left
                continue
            if not seqs_left or not tokens_left:
                break
            if request.loads:  # host-tier hits still to copy in: copies this round, computes after them
                self._load(request, rnd)
                continue
            start = request.num_computed
            tokens = request.tokens
            if (
                len(tokens) - start == 1
                and start >= request.num_prompt
                and len(request.block_table) * block_size > start
                and not request.stop_tail
                and not request.pending_prefill
            ):
                if kv_left <= start:
                    break
                seqs.append(
                    build_seq(
                        request.request_id,
                        request.epoch,
                        request.last_token_ids,  # (tokens[start],): the last token is an output token
                        start,
                        request.block_table,
                        request.sampling,
                        True,
                        start + 1 - request.num_prompt,
                        (),
                        (),
                    )
                )
                entries.append(request)
                request.in_flight_round = in_flight
                # Separate statements: a four-name tuple assignment builds and unpacks a tuple.
                tokens_left -= 1
                seqs_left -= 1
                kv_left -= start + 1
                decodes += 1
                continue
            rnd.tokens_left, rnd.seqs_left, rnd.kv_left = tokens_left, seqs_left, kv_left
            rnd.decode_tokens, decodes = rnd.decode_tokens + decodes, 0
            num = chunk_tokens(config, rnd, start, len(tokens) - start, min(last - index, seqs_left - 1))
            if num <= 0:
                break
            if len(request.block_ids) * block_size >= start + num or self._grow(request, start + num, rnd, now):
                self._place(request, start, num, rnd, now)
            tokens_left, seqs_left, kv_left = rnd.tokens_left, rnd.seqs_left, rnd.kv_left
        rnd.tokens_left, rnd.seqs_left, rnd.kv_left = tokens_left, seqs_left, kv_left
        rnd.decode_tokens += decodes

    def _grow(self, request: Request, end: int, rnd: RoundBuilder, now: float) -> bool:
        """Give `request` blocks up to position `end`, preempting others; False if it was preempted or waits a
        round for the blocks a swap-out is freeing."""
        need = -(-end // self._block_size) - len(request.block_ids)
        while True:
            blocks = self._pool.allocate(need)
            if blocks is not None:
                request.block_ids.extend(blocks)
                # The table grows by the new blocks: tuple(block_ids) would box every id of the array again
                # (a new int per block per boundary: most of a decode's cost at a block boundary).
                request.block_table += tuple(blocks)
                return True
            victim = self._pick_victim(request, rnd.round_id)
            if victim is request and self._table.swapping:
                # Blocks a swap-out still pins come back once its round has run: wait a round for them with
                # the work done so far, rather than throw that work away (see the module docstring); and
                # admit nobody new into them meanwhile.
                rnd.preempted = True
                return False
            self._preempt(victim, rnd, now)
            if victim is request:
                return False

    def _pick_victim(self, needy: Request, round_id: int) -> Request:
        """Return the request to preempt so that `needy` can grow (the victim rule decides).

        Candidates are the running requests not read by an in-flight round (ones placed in this
        round are taken back out); `needy` itself is taken only when the rule ranks it lowest.
        """
        candidates = (
            request
            for request in self._table.running.values()
            if request.in_flight_round in (None, round_id) and request.in_flight_prev is None and request is not needy
            and not request.loads and not request.loading  # blocks that copies still fill: nothing to keep or swap
        )
        return self._victims.choose(needy, candidates)

    def _preempt(self, victim: Request, rnd: RoundBuilder, now: float) -> None:
        """Take `victim` off the device: swap its blocks to host if there is room, else recompute."""
        rnd.preempted = True
        if victim.in_flight_round == rnd.round_id:
            self._unplace(victim, rnd)
        del self._table.running[victim.request_id]
        blocks = victim.block_ids
        # Only blocks with computed KV are worth copying (one grown earlier in this round is not).
        computed = -(-victim.num_computed // self._block_size)
        swap = self._swap and self._host.num_free >= computed
        if swap and computed < len(blocks):
            self._pool.free(reversed(blocks[computed:]))
            blocks = blocks[:computed]
        registered = victim.num_registered
        victim.block_ids, victim.block_table, victim.num_registered = array("q"), (), 0
        apply(victim, Input.PREEMPT)
        victim.usage.preemptions += 1
        self._outbox.preemptions += 1
        if swap:
            host = self._host.take(len(blocks), victim.block_hashes[:registered])
            rnd.swap_out += tuple(BlockCopy(d, h) for d, h in zip(blocks, host, strict=True))
            # Pinned until the copy is done: the worker reads them before this round's forward.
            self._pool.pin(blocks)
            self._pool.free(reversed(blocks))
            victim.swap_pinned, victim.host_blocks = blocks, host
            victim.in_flight_round = rnd.round_id
            rnd.swapping += (victim,)
            self._table.swapping[victim.request_id] = victim
        else:
            self._pool.free(reversed(blocks))
            victim.recompute_debt = max(victim.recompute_debt, victim.num_computed)
            victim.num_computed = 0
            apply(victim, Input.REQUEUE)
            self._backlog.enqueue(victim)
        self._outbox.event(victim, Stage.PREEMPTED, now, (("mode", "swap" if swap else "recompute"),))

    def _schedule_waiting(self, rnd: RoundBuilder, now: float) -> None:
        queue = self._backlog.queue
        while rnd.seqs_left and rnd.tokens_left:
            request = queue.peek()
            if request is None:
                return
            admitted = self._resume_swapped(request, rnd, now) if request.host_blocks else self._admit(request, rnd, now)
            if not admitted:
                return

    def _admit(self, request: Request, rnd: RoundBuilder, now: float) -> bool:
        """Place the head of the queue (first schedule or recompute resume) if it fits."""
        size, pool = self._block_size, self._pool
        hits: list[int] = []
        host_hits: list[int] = []
        if pool.caching:
            hashes = block_hashes_upto(request, (len(request.tokens) - 1) // size, size, request.salt)
            hits = pool.lookup(hashes)
            if self._host.prefix_cache and len(hits) < len(hashes):
                host_hits = self._host.lookup(hashes[len(hits):])
        start = (len(hits) + len(host_hits)) * size
        if host_hits:
            # Copied in first, over as many rounds as host_load_blocks allows; computed from the round after.
            cap = self._config.host_load_blocks
            if cap > 0 and len(rnd.swap_in) >= cap:
                return False  # this round copies in all it may: the next one starts this request's copies
            num = 0
            need = len(host_hits)
        else:
            num = chunk_tokens(self._config, rnd, start, len(request.tokens) - start)
            need = -(-(start + num) // size) - len(hits)
            if num <= 0:
                return False
        if need + pool.count_unreferenced(hits) > pool.num_allocatable:
            return False
        self._backlog.dequeue(request, served=True)
        pool.acquire(hits)
        request.block_ids = array("q", hits)
        fresh = pool.allocate(need) or []
        request.block_ids.extend(fresh)
        request.block_table = tuple(request.block_ids)
        # Host-tier hits are registered on the device, like computed blocks, after the round that computes next.
        request.num_registered = len(hits)
        request.num_computed = start
        if host_hits:
            self._host.read(host_hits)
            request.loads = tuple(BlockCopy(h, d) for h, d in zip(host_hits, fresh, strict=True))
        host_tokens = len(host_hits) * size
        self._backlog.set_pending(request, len(request.tokens) - start)  # cached blocks are no work
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            request.usage.cached_tokens = start
            self._outbox.prefix_hit_tokens += start
            self._outbox.host_hit_tokens += host_tokens
            self._outbox.prefix_query_tokens += len(request.tokens)
            attributes: tuple[tuple[str, int], ...] = (("cached_tokens", start),)
            if host_tokens:
                attributes += (("host_cached_tokens", host_tokens),)
            self._outbox.event(request, Stage.FIRST_SCHEDULED, now, attributes)
        else:
            recomputed = max(0, request.recompute_debt - start)
            request.recompute_debt = 0
            request.usage.recomputed_tokens += recomputed
            self._outbox.recomputed_tokens += recomputed
            self._outbox.host_hit_tokens += host_tokens
            self._outbox.event(request, Stage.RESUMED, now, (("mode", "recompute"), ("cached_tokens", start)))
        self._start_running(request)
        if host_hits:
            self._load(request, rnd)
            return True
        self._place(request, start, num, rnd, now)
        return True

    def _load(self, request: Request, rnd: RoundBuilder) -> None:
        """Copy in the next of `request`'s host-tier hits (at most host_load_blocks a round, shared by the round's
        loads); the request is in flight with this round, without a sequence in it."""
        cap = self._config.host_load_blocks
        room = len(request.loads) if cap <= 0 else cap - len(rnd.swap_in)
        if room <= 0:
            return
        now_copied, request.loads = request.loads[:room], request.loads[room:]
        rnd.swap_in += now_copied
        rnd.host_read += tuple(copy.src for copy in now_copied)
        rnd.loading += (request,)
        request.loading = True
        request.in_flight_round = rnd.round_id

    def _resume_swapped(self, request: Request, rnd: RoundBuilder, now: float) -> bool:
        """Bring a swapped-out request back: device blocks, swap-in copies, then its next chunk."""
        start = request.num_computed
        num = chunk_tokens(self._config, rnd, start, len(request.tokens) - start)
        need = -(-(start + num) // self._block_size)
        if num <= 0 or need > self._pool.num_allocatable:
            return False
        self._backlog.dequeue(request, served=True)
        blocks = self._pool.allocate(need) or []
        rnd.swap_in += tuple(BlockCopy(h, d) for h, d in zip(request.host_blocks, blocks, strict=False))
        # The host copies are read by this round; they are free once its result arrives.
        rnd.host_release += tuple(request.host_blocks)
        request.host_blocks = ()
        request.block_ids, request.block_table, request.num_registered = array("q", blocks), tuple(blocks), 0
        self._outbox.event(request, Stage.RESUMED, now, (("mode", "swap"),))
        self._start_running(request)
        self._place(request, start, num, rnd, now)
        return True

    def _start_running(self, request: Request) -> None:
        apply(request, Input.SCHEDULE)
        self._table.running[request.request_id] = request

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
                tuple(tokens[: request.num_prompt]) if request.sampling.repetition_penalty != 1.0 else (),
            )
        )
        decode = num == 1 and sample and start >= request.num_prompt
        if request.pending_prefill:
            # A chunk that reaches the last known token ends the prefill (what follows is decode).
            self._backlog.set_pending(request, 0 if sample else len(tokens) - end)
        rnd.entries.append(request)
        if not decode:
            if rnd.chunks is None:
                rnd.chunks = {}
            rnd.chunks[request] = (num, sample)
        request.in_flight_round = rnd.round_id
        rnd.tokens_left -= num
        rnd.seqs_left -= 1
        rnd.kv_left -= end
        if decode:
            rnd.decode_tokens += 1
        else:
            rnd.prefill_tokens += num
            # A chunk floored at one block may not fit its whole charge: what is left is charged.
            charge = min(attention_charge(self._config, start, num), rnd.tokens_left)
            if charge:
                rnd.tokens_left -= charge
                rnd.attention_tokens += charge
                if rnd.charges is None:
                    rnd.charges = {}
                rnd.charges[request] = charge

    def _unplace(self, request: Request, rnd: RoundBuilder) -> None:
        """Take a request placed earlier in this round back out (it is being preempted)."""
        entries = rnd.entries
        index = next(i for i in range(len(entries) - 1, -1, -1) if entries[i] is request)
        entries.pop(index)
        chunks = rnd.chunks
        decode = chunks is None or request not in chunks
        num, _ = DECODE if chunks is None or decode else chunks.pop(request)
        seq = rnd.seqs.pop(index)
        request.in_flight_round = None
        rnd.tokens_left += num
        rnd.seqs_left += 1
        rnd.kv_left += seq.start_position + num
        if decode:
            rnd.decode_tokens -= 1
        else:
            rnd.prefill_tokens -= num
            charge = rnd.charges.pop(request, 0) if rnd.charges is not None else 0
            rnd.tokens_left += charge
            rnd.attention_tokens -= charge
            self._backlog.set_pending(request, len(request.tokens) - seq.start_position)

    def _page_out(self, rnd: RoundBuilder) -> None:
        """Copy into the host tier (this round's swap-outs) those of the device's `host_page_out_blocks` least
        recently used cached blocks, the next to be evicted, that it lacks: an eviction then loses nothing. None of
        them is allocated in this round (allocation is done) and a registered block's KV never changes, so the
        copies touch nothing this round's forward writes: the worker may run them beside it (the cost model does)."""
        host, pool = self._host, self._pool
        copies: list[BlockCopy] = []
        written: list[int] = []
        for block, block_hash in pool.to_page_out(self._config.host_page_out_blocks):
            target = host.page_out(block_hash)
            if target is not None:
                copies.append(BlockCopy(block, target))
                written.append(target)
            elif not host.holds(block_hash):  # no room in the tier this round: still to copy
                pool.unpage(block_hash)
        if copies:
            rnd.swap_out += tuple(copies)
            rnd.host_written += tuple(written)

    def _seal(self, rnd: RoundBuilder, now: float) -> RoundPlan:
        config = self._config
        if rnd.prefill_tokens:
            self._note_prefill_chunks(rnd, now)
        # Positional, in RoundBudget's field order (new_round_budget writes the slots directly).
        budget = new_round_budget(
            config.max_num_batched_tokens,
            config.max_num_batched_tokens - rnd.tokens_left - rnd.attention_tokens,
            config.max_num_seqs,
            config.max_num_seqs - rnd.seqs_left,
            config.max_kv_read_tokens,
            (config.max_kv_read_tokens or 1 << 62) - rnd.kv_left,
            rnd.prefill_tokens,
            rnd.decode_tokens,
            rnd.attention_tokens,
        )
        swap_out, swap_in, seqs = rnd.swap_out, rnd.swap_in, rnd.seqs
        plan = new_round_plan(rnd.round_id, tuple(seqs), swap_out, swap_in, budget)
        if seqs or swap_out or swap_in:
            self._outcomes.in_flight[rnd.round_id] = rnd
            self._outbox.rounds += 1
            # The plan holds the sequences; the in-flight record needs only its entries. Letting go
            # of them now, while they are in cache, saves a pass over them when the record is
            # dropped a round later (at 1024 running that pass missed the cache).
            seqs.clear()
        return plan

    def _note_prefill_chunks(self, rnd: RoundBuilder, now: float) -> None:
        # Emitted when the round is sealed, so a chunk taken back by a preemption never shows up.
        account = self._backlog.account
        chunks = rnd.chunks or {}
        charges = rnd.charges or {}
        for seq, request in zip(rnd.seqs, rnd.entries, strict=True):
            if request in chunks:
                num = chunks[request][0]
                attributes: tuple[tuple[str, int], ...] = (("tokens", num), ("start", seq.start_position))
                if request in charges:  # the round's time budget shrank this chunk for its attention
                    attributes += (("attention_tokens", charges[request]),)
                self._outbox.event(request, Stage.PREFILL_CHUNK, now, attributes)
                if account is not None:
                    account(request.tenant, num, 0)
