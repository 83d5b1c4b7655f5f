"""Preemption victim rules: named, replaceable policies behind VictimPolicy and make_victim_rule.

Scenario (block size 4, 7 blocks): A (priority 0, arrives first) and B (priority 5, arrives later)
decode side by side until both need a new block in the same round and only one is left.
"""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step, token_for

from scheduler_svc.core.config import VictimPolicy
from scheduler_svc.core.victims import LatestArrivalFirst, LowestPriorityFirst, make_victim_rule
from sluice.types import Stage


def _preempted_and_outputs(policy: VictimPolicy | str) -> tuple[list[str], dict[str, list[int]]]:
    core = make_core(num_blocks=7, block_size=4, victim_policy=policy)
    core.submit(make_request("A", 8, max_tokens=10, arrival=0.0, priority=0), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5, priority=5), 0.0)
    executor, preempted, outputs, now = FakeExecutor(), [], {}, 1.0
    while core.has_unfinished():
        _, events = step(core, now, executor)
        check_invariants(core)
        preempted += [e.request_id for e in events.lifecycle if e.stage is Stage.PREEMPTED]
        outputs.update({f.request_id: list(f.output_token_ids) for f in events.finished})
        now += 1.0
    return preempted, outputs


def test_lowest_priority_rule_preempts_the_low_priority_earlier_arrival() -> None:
    """The default rule preempts A (priority 0) although B arrived later; both still finish unchanged."""
    preempted, outputs = _preempted_and_outputs(VictimPolicy.LOWEST_PRIORITY)
    assert preempted == ["A"]
    assert outputs == {rid: [token_for(rid, i) for i in range(10)] for rid in ("A", "B")}


def test_latest_arrival_rule_preempts_the_later_arrival_whatever_its_priority() -> None:
    """The latest-arrival rule, named by its value, preempts B (priority 5) because it arrived last."""
    preempted, outputs = _preempted_and_outputs("latest_arrival")
    assert preempted == ["B"]
    assert outputs == {rid: [token_for(rid, i) for i in range(10)] for rid in ("A", "B")}


def test_default_config_uses_the_lowest_priority_rule() -> None:
    """SchedulerConfig's default victim policy is lowest priority, then latest arrival (DESIGN.md)."""
    assert make_core().config.victim_policy is VictimPolicy.LOWEST_PRIORITY
    assert isinstance(make_victim_rule(VictimPolicy.LOWEST_PRIORITY), LowestPriorityFirst)
    assert isinstance(make_victim_rule("LATEST_ARRIVAL"), LatestArrivalFirst)


def test_unknown_victim_policy_is_refused_naming_the_known_ones() -> None:
    """An unknown victim policy name raises ValueError listing every known one; a core is not built."""
    with pytest.raises(ValueError, match="lowest_priority, latest_arrival"):
        make_victim_rule("youngest")
    with pytest.raises(ValueError, match="unknown victim policy 'youngest'"):
        make_core(victim_policy="youngest")
