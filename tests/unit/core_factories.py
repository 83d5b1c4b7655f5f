"""Factories and helpers for the scheduler-core tests: a core, requests, a tiny fake executor.

The fake executor plays the worker's part (it is not the component under test): it answers a
plan with one deterministic token per sampled sequence.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import SchedulerConfig
from sluice.types import (
    CoreEvents,
    Finished,
    NewRequest,
    RequestStatus,
    RoundPlan,
    RoundResult,
    SamplingParams,
    SeqOutput,
)


def make_core(**overrides: object) -> SchedulerCore:
    """Return a core with a small default config (64 blocks of 16 tokens), fields overridable."""
    fields: dict[str, object] = {"num_blocks": 64, "block_size": 16}
    fields.update(overrides)
    return SchedulerCore(SchedulerConfig(**fields))  # type: ignore[arg-type]


def make_request(
    request_id: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    prompt: tuple[int, ...] | None = None,
    arrival: float = 0.0,
    **fields: object,
) -> NewRequest:
    """Return a NewRequest with `prompt_len` distinct prompt tokens unless `prompt` is given."""
    sampling_fields = {k: fields.pop(k) for k in list(fields) if k in SamplingParams.__dataclass_fields__}
    sampling = SamplingParams(max_tokens=max_tokens, **sampling_fields)  # type: ignore[arg-type]
    if prompt is None:
        base = sum(map(ord, request_id)) * 1000
        prompt = tuple(base + i for i in range(prompt_len))
    return NewRequest(request_id, prompt, sampling, arrival_time=arrival, **fields)  # type: ignore[arg-type]


def token_for(request_id: str, output_index: int) -> int:
    """Return the fake executor's token: deterministic per (request, index), never a small id."""
    return 10_000 + output_index


@dataclass
class FakeExecutor:
    """Answers plans like a worker would, recording what it was asked to do."""

    plans: list[RoundPlan] = field(default_factory=list)
    token_fn: object = token_for

    def run(self, plan: RoundPlan) -> RoundResult:
        """Return the result of `plan`: one token per sampled sequence."""
        self.plans.append(plan)
        outputs = tuple(
            SeqOutput(seq.request_id, seq.epoch, (self.token_fn(seq.request_id, seq.output_index),))  # type: ignore[operator]
            if seq.sample
            else SeqOutput(seq.request_id, seq.epoch)
            for seq in plan.seqs
        )
        return RoundResult(plan.round_id, outputs)


def step(core: SchedulerCore, now: float, executor: FakeExecutor | None = None) -> tuple[RoundPlan, CoreEvents]:
    """Schedule one round at `now`, execute it and apply the result; return (plan, events)."""
    plan = core.schedule(now)
    if plan.is_empty:
        return plan, core.take_events()
    result = (executor or FakeExecutor()).run(plan)
    return plan, core.on_round_result(result, now)


def check_invariants(core: SchedulerCore) -> None:
    """Assert the core's ledgers agree: blocks, references, pins, host blocks, request places, the queue bound."""
    assert core.num_waiting <= core.config.max_waiting, "preemptions pushed the queue past its bound"
    pool = core.pool
    assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks
    free, cached = pool.free_block_ids(), pool.cached_block_ids()
    assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
    assert not set(free) & set(cached)
    expected = Counter[int]()
    for request in core.requests.live.values():
        expected.update(request.block_ids)
        expected.update(request.swap_pinned)
    # Ended requests that a round placed ahead still reads keep their blocks pinned until it answers.
    held = {id(r): r for record in core.outcomes.in_flight.values() for r in record.entries if r.held_blocks}
    for request in held.values():
        assert request.status.is_terminal and request.in_flight_round in core.outcomes.in_flight
        expected.update(request.held_blocks)
    handoffs = core.handoffs.holds()  # finished prefill requests' prompt blocks, pinned for a decode replica
    for hold in handoffs:
        expected.update(hold.block_ids)
    assert core.handoffs.held_blocks == sum(len(hold.block_ids) for hold in handoffs)
    for block in range(pool.num_blocks):
        assert pool.refcount(block) >= 0
        assert pool.refcount(block) == expected[block], f"block {block}: refcount vs holders"
        if block in free or block in cached:
            assert pool.refcount(block) == 0
    pinned = Counter[int]()
    for request in core.requests.live.values():
        pinned.update(request.swap_pinned)
    for request in held.values():
        pinned.update(request.held_blocks)
    for hold in handoffs:
        pinned.update(hold.block_ids)
    assert all(pool.pin_count(b) == pinned[b] for b in range(pool.num_blocks))
    _check_places(core)
    _check_host(core)
    _check_pending_prefill(core)
    _check_round_caches(core)


def _check_round_caches(core: SchedulerCore) -> None:
    """What the round builder reads instead of recomputing agrees with what it stands for."""
    for request in core.requests.live.values():
        assert request.block_table == tuple(request.block_ids), f"{request}: block_table"
        if len(request.tokens) > request.num_prompt:
            assert request.last_token_ids == (request.tokens[-1],), f"{request}: last_token_ids"
    assert core.backlog.queue.length == len(core.backlog.queue.live())


def _check_pending_prefill(core: SchedulerCore) -> None:
    """The reported pending prefill is the sum of each live request's unscheduled prefill."""
    in_flight = Counter[int]()  # a request placed ahead is read by two rounds: both chunks are scheduled
    for record in core.outcomes.in_flight.values():
        for request in record.entries:
            in_flight[id(request)] += record.entry(request)[0]
    for request in core.requests.live.values():
        unscheduled = len(request.tokens) - request.num_computed - in_flight.get(id(request), 0)
        if request.status is RequestStatus.WAITING:  # less what the cache held at submission
            assert 0 < request.pending_prefill <= len(request.tokens) - request.num_computed
        elif request.status is RequestStatus.CANCELLING:
            assert request.pending_prefill == 0
        elif request.status is RequestStatus.RUNNING:
            assert 0 <= request.pending_prefill <= max(unscheduled, 0), f"{request}: {request.pending_prefill}"
    assert core.stats().queued_prefill_tokens == sum(r.pending_prefill for r in core.requests.live.values())


def _check_places(core: SchedulerCore) -> None:
    places = {
        RequestStatus.WAITING: [r.request_id for r in core.backlog.queue.live()],
        RequestStatus.RUNNING: list(core.requests.running),
        RequestStatus.PREEMPTED: list(core.requests.swapping),
        RequestStatus.CANCELLING: list(core.requests.cancelling),
    }
    seen: list[str] = []
    for status, ids in places.items():
        for rid in ids:
            assert core.requests.live[rid].status is status, f"{rid} is {core.requests.live[rid].status} in {status} place"
        seen.extend(ids)
    assert sorted(seen) == sorted(core.requests.live), "every live request is in exactly one place"
    assert len(core.backlog.queue) == len(places[RequestStatus.WAITING])


def _check_host(core: SchedulerCore) -> None:
    host = list(core.host.free_ids())
    for request in core.requests.live.values():
        host.extend(request.host_blocks)
    for record in core.outcomes.in_flight.values():
        host.extend(record.host_release)
    cached, pending, read = core.host.tier_ids()
    host.extend(cached)
    host.extend(pending)
    host.extend(read)
    assert sorted(host) == list(range(core.config.num_host_blocks)), "host blocks leaked or doubled"
    # The prefix tier: pending copies are exactly the in-flight rounds' page-outs; readers are the in-flight swap-ins.
    written = [block for record in core.outcomes.in_flight.values() for block in record.host_written]
    assert sorted(written) == sorted(pending), "a pending host copy without its round, or the reverse"
    readers = Counter(block for record in core.outcomes.in_flight.values() for block in record.host_read)
    readers.update(copy.src for request in core.requests.live.values() for copy in request.loads)
    assert readers == Counter(read), "host-tier readers disagree with the in-flight swap-ins and the loads to come"
    pool = core.pool
    if core.host.prefix_cache:  # the pool's marks: a block it marks as held by the tier is held (or being copied)
        paged = set(pool.paged_block_ids())
        for block_hash in pool.cached_hashes():
            for block in pool.lookup([block_hash]):
                assert block not in paged or core.host.holds(block_hash), f"block {block}: marked, not held"
    for request in core.requests.live.values():
        assert not request.loading or request.in_flight_round in core.outcomes.in_flight, f"{request}: loading"
        assert not request.loads or request.status in (RequestStatus.RUNNING, RequestStatus.CANCELLING)


def with_config(core: SchedulerCore, **overrides: object) -> SchedulerConfig:
    """Return `core`'s config with fields replaced (for building a sibling core)."""
    return replace(core.config, **overrides)  # type: ignore[arg-type]


def drive(
    core: SchedulerCore,
    arrivals: list[tuple[float, NewRequest]],
    round_time: float,
    until: float = float("inf"),
) -> tuple[list[RoundPlan], list[Finished]]:
    """Run `core` against timed arrivals with a fixed time per round; return (plans, finished records)."""
    executor, plans, finished, now = FakeExecutor(), [], [], 0.0
    pending = sorted(arrivals, key=lambda a: a[0])
    while (pending or core.has_unfinished()) and now < until:
        while pending and pending[0][0] <= now:
            core.submit(pending.pop(0)[1], now)
        plan = core.schedule(now)
        if plan.is_empty:
            if not pending:
                break
            now = pending[0][0]
            continue
        now += round_time
        plans.append(plan)
        finished += core.on_round_result(executor.run(plan), now).finished
    return plans, finished
