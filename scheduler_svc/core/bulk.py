"""Steady decode runs in bulk: k pipelined decode rounds of the same requests in one call.

A replica that only decodes, with two rounds in flight (overlap scheduling) that both read every
running request as a plain decode, repeats the same steps each round: the older round's result
appends one token per request (registering a block it fills: a STORED event), and the next round
places every request ahead again (with a new block from the free list at a boundary). Nothing is
queued, evicted, started or finished. `advance_decodes` applies k such cycles at once,
leaving the core exactly as k `on_round_result` + `schedule(now, overlap=True)` pairs would (round ids,
counters, token events in the same order, the two in-flight rounds); `decode_run_limit` says how many
cycles can be taken before anything needs a round of its own (a first token, a finish, the KV read
cap, a block the free list cannot give without an eviction). See docs/scheduler-core.md, "Bulk decode runs".
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING

from scheduler_svc.core.ahead import PENDING
from scheduler_svc.core.request import Request
from scheduler_svc.core.round import InFlightRound, new_round_budget, new_round_plan, new_scheduled_seq
from sluice.types import CoreEvents, RequestStatus, RoundPlan

if TYPE_CHECKING:
    from scheduler_svc.core.scheduler import SchedulerCore


def steady_decodes(core: SchedulerCore, min_cycles: int = 1, max_cycles: int = 1 << 62) -> tuple[
        list[Request], int] | None:
    """Return (the running requests in plan order, `decode_run_limit`) when the core is in a steady decode
    state with at least `min_cycles` cycles to take, else None.

    Steady: exactly two rounds in flight, both plain decodes of every running request (the newer one
    placed ahead), nothing queued, swapping, pending, accounted, or waiting in the outbox, and no
    request with stop strings, stop tokens, an EOS token, a pending prefill or a lost round.
    """
    in_flight = core.outcomes.in_flight
    if len(in_flight) != 2 or len(core.backlog) or core.requests.swapping or core.backlog.account is not None:
        return None
    events = core.outbox.events
    if events.tokens or events.lifecycle or events.finished or events.dropped_results:
        return None
    first, second = in_flight
    if first > second:
        first, second = second, first
    older, newer = in_flight[first], in_flight[second]
    running = list(core.requests.running.values())
    if not running:
        return None
    for record in (older, newer):
        if record.chunks is not None or record.swapping or record.host_release or record.entries != running:
            return None
    status = RequestStatus.RUNNING
    size = core.config.block_size
    limit = 1 << 62
    for request in running:
        length = len(request.tokens)
        index = length - request.num_prompt
        if (
            request.status is not status
            or request.in_flight_prev != first
            or request.in_flight_round != second
            or request.num_computed + 1 != length
            or index == 0
            or request.stop_tail
            or request.pending_prefill
            or request.lost_rounds
            or request.eos_token_id is not None
            or request.stop_token_ids
            or request.sampling.logprobs is not None
        ):
            return None
        # Cycle m appends output token index + m and places position length + m + 1 ahead: not the last token.
        if request.max_tokens - 2 - index < limit:
            limit = request.max_tokens - 2 - index
            if limit < min_cycles:
                return None
    limit = min(limit, max_cycles)
    cap = core.config.max_kv_read_tokens
    if cap is not None:
        limit = _kv_cap_limit(running, cap, limit)
    limit = _allocation_limit(running, size, core.pool.num_allocatable, limit)
    return (running, limit) if limit >= min_cycles else None


def _allocations(running: Sequence[Request], size: int, k: int) -> int:
    """Return the blocks k cycles allocate: a request's placement ahead crosses a boundary every `size` cycles."""
    total = 0
    for request in running:
        first = len(request.block_table) * size - len(request.tokens) - 1  # the cycle of its next boundary
        if k > first:
            total += 1 + (k - 1 - first) // size
    return total


def _allocation_limit(running: Sequence[Request], size: int, free: int, limit: int) -> int:
    """Return the most cycles (<= limit) whose new blocks the pool can give (`free`: free + evictable)."""
    if _allocations(running, size, limit) <= free:
        return limit
    low, high = 0, limit  # allocations(low) <= free < allocations(high)
    while high - low > 1:
        middle = (low + high) // 2
        if _allocations(running, size, middle) <= free:
            low = middle
        else:
            high = middle
    return low


def decode_run_limit(core: SchedulerCore, running: Sequence[Request]) -> int:
    """Return how many steady cycles `advance_decodes` may take from now for `running` (0: none).

    Cycle m appends output token `len(tokens) - num_prompt + m` of each request and places position
    `len(tokens) + m + 1` ahead; it must not be a first or last token, exceed the KV read cap, or need
    a block the pool cannot give (free, or cached and evicted: a REMOVED event).
    """
    steady = steady_decodes(core)
    if steady is None or steady[0] != list(running):
        return 0
    return steady[1]


def _kv_cap_limit(running: Sequence[Request], cap: int, limit: int) -> int:
    """Return the cycles whose placements ahead stay within the KV read cap (as the batcher checks it)."""
    for m in range(max(limit, 0)):
        kv_left = cap
        for request in running:
            start = len(request.tokens) + m + 1
            if kv_left <= start:
                return m
            kv_left -= start + 1
    return limit


def advance_decodes(core: SchedulerCore, running: list[Request], tokens: Sequence[Sequence[int]],
                    token_events: bool = True) -> tuple[CoreEvents, RoundPlan | None, RoundPlan, list[tuple[int, int]]]:
    """Apply k = len(tokens[0]) steady cycles; `tokens[i]` are request i's next k sampled tokens.

    Returns (what the k results' `take_events` would have returned, concatenated, the token events left
    out when `token_events` is False (a caller that has the tokens already); the plans of the two
    rounds left in flight that the caller has not seen: the older one, None when k == 1 as the caller
    holds it, and the newer one; the pool's (free, cached) blocks after each cycle). Events of the last
    placement ahead (evictions) stay in the pool, as the last `schedule` leaves them. Raises ValueError
    when k exceeds `decode_run_limit` (nothing is changed then).
    """
    k = len(tokens[0]) if tokens else 0
    if k < 1 or len(tokens) != len(running) or any(len(row) != k for row in tokens) or k > decode_run_limit(core, running):
        raise ValueError(f"advance_decodes: {k} cycles for {len(running)} requests exceed the steady run")
    in_flight = core.outcomes.in_flight
    first, second = sorted(in_flight)
    batcher = core.batcher
    base_id = batcher.next_round_id
    batcher.next_round_id += k
    core.outbox.rounds += k
    newest = base_id + k - 1
    older_id = second if k == 1 else newest - 1
    size, pool = core.config.block_size, core.pool
    events = CoreEvents(tokens=_token_events(running, tokens, k) if token_events else [])
    # The block work of the k cycles, in their order: (cycle, 0 = a result registers a full block,
    # 1 = a placement ahead takes a new block, plan position).
    steps = _block_steps(running, size, pool.caching, k)
    computed0 = [request.num_computed for request in running]
    for request, row in zip(running, tokens, strict=True):
        request.tokens.extend(row)
    outcomes = core.outcomes  # its method called on it, not as a bound method: compiled, a native call, no argument parsing
    older_tables: list[tuple[int, ...]] | None = None
    pool_after: list[tuple[int, int]] = []
    for m, phase, i in steps:
        if len(pool_after) < m:  # cycles since the last step changed no block: the pool as it is now
            pool_after.extend([(pool.num_free, pool.num_cached)] * (m - len(pool_after)))
        request = running[i]
        if phase == 0:
            request.num_computed = computed0[i] + m + 1
            outcomes._register_full_blocks(request)
            continue
        if m == k - 1 and older_tables is None:
            # the k-th result's take: everything so far; the last placements ahead are the next round's
            older_tables = _tables(running)
            events.kv_events.extend(pool.take_events())
        request.block_ids.extend(pool.allocate(1) or ())
    if older_tables is None:
        older_tables = _tables(running)
        events.kv_events.extend(pool.take_events())
    _tables(running)
    pool_after.extend([(pool.num_free, pool.num_cached)] * (k - len(pool_after)))
    for request, computed in zip(running, computed0, strict=True):
        request.num_computed = computed + k
    for request, row in zip(running, tokens, strict=True):
        request.last_token_ids = (row[-1],)
        request.in_flight_prev = older_id
        request.in_flight_round = newest
    del in_flight[first]
    older_plan = None
    if k > 1:
        del in_flight[second]
        in_flight[older_id] = _record(older_id, running)
        older_plan = _ahead_plan(core, older_id, running, 1, older_tables)
    in_flight[newest] = _record(newest, running)
    return events, older_plan, _ahead_plan(core, newest, running, 0, [r.block_table for r in running]), pool_after


def _token_events(running: Sequence[Request], tokens: Sequence[Sequence[int]], k: int) -> list[tuple[str, int, int]]:
    """Return the k cycles' token events, cycle by cycle in plan order (as k results emit them), built at C speed."""
    per_request = [list(zip(repeat(r.request_id, k), range(len(r.tokens) - r.num_prompt, len(r.tokens) - r.num_prompt + k),
                            row, strict=True)) for r, row in zip(running, tokens, strict=True)]
    return list(chain.from_iterable(zip(*per_request, strict=True)))


def _block_steps(running: Sequence[Request], size: int, caching: bool, k: int) -> list[tuple[int, int, int]]:
    """Return the registrations and allocations of k cycles as (cycle, phase, plan position), in their order.

    A result fills a block when the computed prefix reaches a multiple of `size` (registered, with prefix
    caching); a placement ahead at position p needs a block when p reaches the end of the block table.
    """
    steps = []
    for i, request in enumerate(running):
        computed = request.num_computed
        if caching:
            # cycle m computes computed + m + 1 positions; it registers when that passes num_registered's blocks
            m = max(0, (request.num_registered + 1) * size - computed - 1)
            while m < k:
                steps.append((m, 0, i))
                m = max(m + 1, ((computed + m + 1) // size + 1) * size - computed - 1)
        m = len(request.block_table) * size - len(request.tokens) - 1
        while m < k:
            steps.append((m, 1, i))
            m += size
    steps.sort()
    return steps


def _tables(running: Sequence[Request]) -> list[tuple[int, ...]]:
    """Bring each block table up to its block ids (set once per run, not per new block) and return them."""
    tables = []
    for request in running:
        table = request.block_table
        if len(table) != len(request.block_ids):  # blocks were only appended: box only the new ids
            table = request.block_table = table + tuple(request.block_ids[len(table):])
        tables.append(table)
    return tables


def _record(round_id: int, running: list[Request]) -> InFlightRound:
    record = InFlightRound(round_id)
    record.entries = list(running)
    return record


def _ahead_plan(core: SchedulerCore, round_id: int, running: list[Request], back: int,
                tables: list[tuple[int, ...]]) -> RoundPlan:
    """The plan `schedule(now, overlap=True)` built for a round of plain decodes placed ahead, `back` tokens ago."""
    config = core.config
    seqs = []
    used = 0
    for request, table in zip(running, tables, strict=True):
        start = len(request.tokens) - back
        seqs.append(new_scheduled_seq(request.request_id, request.epoch, PENDING, start, table,
                                      request.sampling, True, start + 1 - request.num_prompt, (), ()))
        used += start + 1
    n = len(running)
    budget = new_round_budget(config.max_num_batched_tokens, n, config.max_num_seqs, n,
                              config.max_kv_read_tokens, used, 0, n, 0)
    return new_round_plan(round_id, tuple(seqs), (), (), budget)
