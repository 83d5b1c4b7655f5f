"""Waiting-queue policies: the factory, each order, lazy removal, aging and fair-share counters."""

from __future__ import annotations

import math

import pytest

from scheduler_svc.core.config import Policy, SchedulerConfig
from scheduler_svc.core.policies import FairQueue, make_queue
from scheduler_svc.core.request import Request
from sluice.types import NewRequest

_seq = iter(range(1, 1_000_000))


def _req(rid: str, arrival: float = 0.0, **fields: object) -> Request:
    return Request(NewRequest(rid, (1, 2, 3), arrival_time=arrival, **fields), next(_seq))  # type: ignore[arg-type]


def _drain(queue) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    while len(queue):
        out.append(queue.pop().request_id)
    return out


def test_unknown_policy_name_lists_the_known_ones() -> None:
    """make_queue raises ValueError naming every known policy for an unknown name."""
    with pytest.raises(ValueError, match="fcfs, priority, fair, edf"):
        make_queue("lottery", SchedulerConfig(num_blocks=1))
    assert type(make_queue("FAIR", SchedulerConfig(num_blocks=1))) is FairQueue


def test_fcfs_orders_by_arrival_and_a_requeued_request_keeps_its_place() -> None:
    """FCFS pops by arrival; a request pushed back (preempted) goes ahead of later arrivals."""
    queue = make_queue(Policy.FCFS, SchedulerConfig(num_blocks=1))
    a, b, c = _req("a", 1.0), _req("b", 2.0), _req("c", 3.0)
    for r in (b, c, a):
        queue.push(r)
    assert queue.pop() is a
    queue.push(a)
    assert _drain(queue) == ["a", "b", "c"]


def test_lazy_removal() -> None:
    """A removed request is never returned, and len counts only live entries."""
    queue = make_queue(Policy.FCFS, SchedulerConfig(num_blocks=1))
    a, b = _req("a", 1.0), _req("b", 2.0)
    queue.push(a)
    queue.push(b)
    assert queue.remove(a) and not queue.remove(a)
    assert len(queue) == 1 and queue.peek() is b and queue.live() == [b]


def test_priority_with_aging_static_key() -> None:
    """Priority 5 arriving 10 s after priority 0 ranks behind it at aging 1/s, ahead of it at 0.1/s."""
    for rate, order in ((1.0, ["old", "new"]), (0.1, ["new", "old"])):
        queue = make_queue(Policy.PRIORITY, SchedulerConfig(num_blocks=1, aging_rate=rate))
        queue.push(_req("old", 0.0, priority=0))
        queue.push(_req("new", 10.0, priority=5))
        assert _drain(queue) == order


def test_edf_orders_by_deadline_none_last_ties_by_arrival() -> None:
    """EDF pops the earliest deadline; requests without one come last, ties by arrival."""
    queue = make_queue(Policy.EDF, SchedulerConfig(num_blocks=1))
    for r in (_req("none", 0.0), _req("late", 1.0, deadline=9.0), _req("t2", 2.0, deadline=5.0), _req("t1", 1.5, deadline=5.0)):
        queue.push(r)
    assert _drain(queue) == ["t1", "t2", "late", "none"]


def test_fair_serves_smallest_counter_and_lifts_a_waking_tenant() -> None:
    """The tenant with the smallest virtual counter goes next; a tenant waking up starts at the active minimum."""
    config = SchedulerConfig(num_blocks=1, policy=Policy.FAIR, tenant_weights=(("gold", 2.0),))
    queue = make_queue(config.policy, config)
    queue.push(_req("g1", 0.0, tenant="gold"))
    queue.push(_req("s1", 0.0, tenant="silver"))
    queue.on_service("gold", 100, 0)   # 100 / 2 = 50
    queue.on_service("silver", 60, 0)  # 60 / 1 = 60
    assert queue.peek().request_id == "g1"
    queue.on_service("silver", 1000, 0)
    queue.push(_req("i1", 0.0, tenant="idle"))
    assert queue.counters["idle"] == pytest.approx(50.0), "lifted to the smallest active counter"
    assert queue.pop().request_id == "g1"


def test_a_tenant_back_after_a_gap_keeps_at_most_the_return_credit() -> None:
    """A tenant whose last live request ended less than `fair_return_window_s` ago comes back lifted to the active
    minimum less `fair_return_credit`: it keeps what it was owed up to the credit (a closed-loop client's next
    request on its way must not forfeit its share), never more; with credit 0, or after a longer gap, it keeps
    nothing, as a new tenant does."""
    for credit, gap, expected in ((300.0, 0.5, 700.0), (0.0, 0.5, 1000.0), (5000.0, 0.5, 100.0), (300.0, 1.5, 1000.0)):
        config = SchedulerConfig(num_blocks=1, policy=Policy.FAIR, fair_return_credit=credit, fair_return_window_s=1.0)
        queue = make_queue(config.policy, config)
        queue.on_live("a", 1, 0.0)
        queue.push(_req("a1", 0.0, tenant="a"))
        queue.on_live("b", 1, 0.0)
        queue.push(_req("b1", 0.0, tenant="b"))
        assert queue.pop().request_id == "a1"
        queue.on_service("a", 100, 0)   # a: 100
        queue.on_live("a", -1, 1.0)     # a's request ended at 1.0; its next one is on its way
        queue.on_service("b", 1000, 0)  # b: 1000, served meanwhile
        queue.on_live("a", 1, 1.0 + gap)
        queue.push(_req("a2", 1.0 + gap, tenant="a"))
        assert queue.counters["a"] == pytest.approx(expected), (credit, gap)
        assert queue.peek().request_id == ("a2" if expected < 1000 else "b1")  # a tie: the earlier arrival


def test_a_tenant_with_requests_running_keeps_the_credit_when_its_queue_empties() -> None:
    """A tenant still live (a request decoding) whose queue emptied never left: its next request is lifted with
    the credit even when it came back from a long gap before."""
    config = SchedulerConfig(num_blocks=1, policy=Policy.FAIR, fair_return_credit=300.0, fair_return_window_s=1.0)
    queue = make_queue(config.policy, config)
    queue.on_live("b", 1, 0.0)
    queue.push(_req("b1", 0.0, tenant="b"))
    queue.on_live("a", 1, 0.0)
    queue.push(_req("a1", 0.0, tenant="a"))  # a new tenant: starts at b's counter
    assert [queue.pop().request_id, queue.pop().request_id] == ["b1", "a1"]  # a tie: the earlier queued first
    queue.on_service("b", 1000, 0)
    queue.on_live("a", 1, 2.0)
    queue.push(_req("a2", 2.0, tenant="a"))  # a1 still running: a is owed 1000, keeps 300
    assert queue.counters["a"] == pytest.approx(700.0)


def test_the_return_credit_must_be_finite_and_not_negative() -> None:
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="fair_return_credit"):
            make_queue(Policy.FAIR, SchedulerConfig(num_blocks=1, policy=Policy.FAIR, fair_return_credit=bad))


def test_srpf_orders_by_remaining_prefill_aged_by_arrival() -> None:
    """At 1,000 tokens/s a 4,000-token prefill arriving at 0 (key 4) goes after a 500-token one arriving at 1
    (key 1.5) but before a 100-token one arriving at 5 (key 5.1); a preempted request (already scheduled) counts
    no prefill and keeps its arrival (key 2)."""
    queue = make_queue(Policy.SRPF, SchedulerConfig(num_blocks=1, srpf_tokens_per_s=1000.0))
    requests = {"long": (0.0, 4000), "short": (1.0, 500), "later": (5.0, 100), "resumed": (2.0, 3000)}
    for rid, (arrival, pending) in requests.items():
        request = _req(rid, arrival)
        request.pending_prefill = pending
        if rid == "resumed":
            request.first_scheduled_time = 2.5
        queue.push(request)
    assert _drain(queue) == ["short", "resumed", "long", "later"]


def test_srpf_queue_of_a_core_uses_the_pending_prefill_left_by_the_prefix_cache() -> None:
    """Through a core: the queue key is set after the pending prefill (less the cached prefix) is known, so a
    long prompt whose prefix is cached overtakes a shorter uncached one that arrived at the same time."""
    from core_factories import FakeExecutor, make_core, make_request, step

    core = make_core(num_blocks=64, block_size=4, policy=Policy.SRPF, max_num_seqs=1, max_num_batched_tokens=64,
                     max_prefill_chunk=64, max_model_len=256)
    warm = tuple(range(1000, 1040))
    core.submit(make_request("warm", prompt=warm, max_tokens=1, arrival=0.0), 0.0)
    executor, now = FakeExecutor(), 1.0
    while core.has_unfinished():
        step(core, now, executor)
        now += 1.0
    core.submit(make_request("blocker", 8, max_tokens=3, arrival=now), now)
    step(core, now, executor)  # the blocker runs; the next two wait behind max_num_seqs 1
    core.submit(make_request("fresh", 30, max_tokens=1, arrival=now), now)  # 30 tokens to prefill
    core.submit(make_request("cached", prompt=(*warm, 1, 2, 3, 4), max_tokens=1, arrival=now), now)  # 4 to prefill
    order = [r.request_id for r in core.backlog.queue.live()]
    assert order == ["cached", "fresh"]
