"""The core's bulk decode step: k steady cycles in one `advance_decodes` leave the core as k single rounds do."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from core_factories import FakeExecutor, check_invariants, make_core, make_request, token_for
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core import SchedulerCore
from sluice.core_errors import RequestRejected
from sluice.types import CoreEvents, KvEventKind, RoundPlan


def _drive_until_steady(core: SchedulerCore, worker: FakeExecutor, skip: int = 0, limit: int = 400) -> list[
        RoundPlan] | None:
    """Run pipelined rounds (result of the older, then plan ahead) until the core is steady for the
    (skip+1)-th time; return the two plans."""
    rounds = [core.schedule(0.0, overlap=True)]
    rounds.append(core.schedule(0.0, overlap=True))
    rounds = [p for p in rounds if not p.is_empty]
    for step in range(limit):
        if len(rounds) == 2 and core.steady_decodes() is not None:
            if not skip:
                return rounds
            skip -= 1
        if not rounds:
            return None
        core.on_round_result(worker.run(rounds.pop(0)), step * 0.01)
        ahead = core.schedule(step * 0.01, overlap=True)
        if not ahead.is_empty:
            rounds.append(ahead)
    return None


def _single(core: SchedulerCore, rounds: list[RoundPlan], worker: FakeExecutor, k: int) -> tuple[
        list[CoreEvents], list[tuple[int, int]]]:
    events, free = [], []
    for _ in range(k):
        events.append(core.on_round_result(worker.run(rounds.pop(0)), 1.0))
        ahead = core.schedule(1.0, overlap=True)
        assert not ahead.is_empty
        rounds.append(ahead)
        free.append((core.pool.num_free, core.pool.num_cached))
    return events, free


def _finish(core: SchedulerCore, rounds: list[RoundPlan], worker: FakeExecutor) -> list[tuple[object, ...]]:
    """Play the core to the end; return every token and finish it reports."""
    out: list[tuple[object, ...]] = []
    while rounds:
        events = core.on_round_result(worker.run(rounds.pop(0)), 2.0)
        out += events.tokens + [(f.request_id, f.status) for f in events.finished]
        ahead = core.schedule(2.0, overlap=True)
        if not ahead.is_empty:
            rounds.append(ahead)
        check_invariants(core)
    return out


def _state(core: SchedulerCore) -> object:
    requests = [(r.request_id, list(r.tokens), r.num_computed, r.in_flight_round, r.in_flight_prev, r.last_token_ids,
                 list(r.block_ids), r.block_table, r.num_registered, r.status) for r in core.requests.live.values()]
    flights = {rid: [r.request_id for r in rec.entries] for rid, rec in core.outcomes.in_flight.items()}
    return (requests, flights, core.batcher.next_round_id, core.stats(), core.pool.free_block_ids(),
            core.pool.cached_block_ids(), core.kv_snapshot())


Build = Callable[[], tuple[SchedulerCore, "list[RoundPlan] | None"]]
"""Builds a core and drives it to a steady state; called thrice for three identical cores (the core is
deterministic; a compiled core cannot be deep-copied)."""


def _advance_and_compare(build: Build, cycles: int) -> CoreEvents | None:
    """Advance a steady core by min(cycles, limit) in bulk and a twin one round at a time; assert they agree.

    None: the build never reached a steady state."""
    core, rounds = build()
    if rounds is None:
        return None
    single_core, single_rounds = build()
    quiet_core, _ = build()  # the same advance without token events (the simulator's call)
    assert rounds is not None and single_rounds is not None
    assert _state(single_core) == _state(core) == _state(quiet_core)
    steady = core.steady_decodes()
    assert steady is not None
    running, limit = steady
    assert core.decode_run_limit(running) == limit
    k = min(cycles, limit)
    single, single_pool = _single(single_core, single_rounds, FakeExecutor(), k)
    tokens = [[token_for(r.request_id, len(r.tokens) - r.num_prompt + m) for m in range(k)] for r in running]
    quiet_running = list(quiet_core.requests.running.values())
    quiet = quiet_core.advance_decodes(quiet_running, tokens, token_events=False)
    bulk_events, older, newer, pool_after = core.advance_decodes(running, tokens)
    assert quiet[0].tokens == [] and quiet[0].kv_events == bulk_events.kv_events
    assert quiet[1:] == (older, newer, pool_after)
    assert _state(quiet_core) == _state(core)
    left = core.take_events()
    assert quiet_core.take_events() == left
    assert bulk_events.tokens == [t for e in single for t in e.tokens]
    assert bulk_events.kv_events == [kv for e in single for kv in e.kv_events]
    assert not any(e.lifecycle or e.finished or e.dropped_results for e in single)
    assert pool_after == single_pool
    assert left == single_core.take_events()  # what the last placements ahead left
    assert (older if older is not None else rounds[1]) == single_rounds[0]
    assert newer == single_rounds[1]
    assert _state(core) == _state(single_core)
    check_invariants(core)
    bulk_rounds = [older if older is not None else rounds[1], newer]
    assert _finish(core, bulk_rounds, FakeExecutor()) == _finish(single_core, single_rounds, FakeExecutor())
    assert _state(core) == _state(single_core)
    bulk_events.kv_events.extend(left.kv_events)
    return bulk_events


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([4, 16]),
    num_blocks=st.sampled_from([12, 24, 256]),
    caching=st.booleans(),
    kv_cap=st.sampled_from([None, 300, 2000]),
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(2, 60)), min_size=1, max_size=5),
    shared=st.booleans(),
    cycles=st.integers(1, 40),
    skip=st.integers(0, 40),
)
def test_advance_equals_single_rounds(block_size: int, num_blocks: int, caching: bool, kv_cap: int | None,
                                      lengths: list[tuple[int, int]], shared: bool, cycles: int, skip: int) -> None:
    """On random steady states, one advance of k cycles (block boundaries and full blocks included) gives the same
    state, token and KV events, plans and future as k rounds."""
    def build() -> tuple[SchedulerCore, list[RoundPlan] | None]:
        core = make_core(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                         max_kv_read_tokens=kv_cap)
        for i, (prompt_len, max_tokens) in enumerate(lengths):
            prompt = tuple(range(1, prompt_len + 1)) if shared else None
            with contextlib.suppress(RequestRejected):  # one that never fits the pool
                core.submit(make_request(f"r{i}", prompt_len=prompt_len, max_tokens=max_tokens, prompt=prompt), 0.0)
        return core, _drive_until_steady(core, FakeExecutor(), skip)

    _advance_and_compare(build, cycles)


def test_a_run_that_evicts_cached_blocks_matches_single_rounds() -> None:
    """With the free list empty, blocks crossed into evict cached ones: the REMOVED events come out as k rounds emit them."""
    def build() -> tuple[SchedulerCore, list[RoundPlan] | None]:
        core = make_core(num_blocks=6, block_size=4)
        worker = FakeExecutor()
        core.submit(make_request("a", prompt_len=8, max_tokens=3), 0.0)
        rounds = _drive_until_steady(core, worker, limit=50)
        assert rounds is None  # "a" ran to its end and left its two full blocks cached
        assert core.pool.num_cached == 2
        core.submit(make_request("b", prompt_len=4, max_tokens=20), 0.0)
        return core, _drive_until_steady(core, worker)

    events = _advance_and_compare(build, 40)
    assert events is not None
    assert sum(1 for e in events.kv_events if e.kind is KvEventKind.REMOVED) == 2


def test_advance_past_the_limit_changes_nothing() -> None:
    """Asking for more cycles than the steady run allows raises and leaves the core as it was."""
    core = make_core(block_size=16)
    core.submit(make_request("a", prompt_len=20, max_tokens=50), 0.0)
    worker = FakeExecutor()
    rounds = _drive_until_steady(core, worker)
    assert rounds is not None
    steady = core.steady_decodes()
    assert steady is not None
    running, limit = steady
    before = _state(core)
    try:
        core.advance_decodes(running, [[10_000] * (limit + 1)])
    except ValueError:
        pass
    else:
        raise AssertionError("advance past the limit was accepted")
    assert _state(core) == before
