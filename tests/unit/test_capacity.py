"""Capacity search: the highest rate scale meeting the attainment goal, found by bracketing and bisection."""

from __future__ import annotations

import pytest

from sluice_tools.capacity import CapacitySearch, Probe, find_capacity
from sluice_tools.workload import WorkloadRequest, ideal_prefix_hit_rate, offered_rate


def _system(knee: float, base_rps: float = 10.0):  # type: ignore[no-untyped-def]
    """A stand-in whose attainment is 99% up to `knee` x the base rate and falls linearly after it."""
    def probe(scale: float) -> Probe:
        attainment = 0.99 if scale <= knee else max(0.0, 0.99 - (scale - knee))
        return Probe(scale, base_rps * scale, attainment, p99_ttft_s=scale)
    return probe


@pytest.mark.parametrize("knee", [0.07, 0.6, 1.0, 3.3, 20.0])
def test_search_finds_the_highest_passing_rate_within_tolerance(knee: float) -> None:
    """Wherever the knee lies (below or above scale 1), the capacity is within the tolerance below the true one."""
    search = CapacitySearch(goal=0.9, tolerance=0.05)
    result = find_capacity(_system(knee), search)
    true_scale = knee + 0.09  # attainment 0.99 - (s - knee) >= 0.9
    assert result.bracketed
    assert true_scale / (1 + search.tolerance) <= result.scale <= true_scale
    assert result.capacity_rps == pytest.approx(10.0 * result.scale)
    assert result.p99_ttft_s == result.scale, "p99 TTFT reported at the capacity point"
    assert all(p.attainment >= 0.9 for p in result.probes if p.scale <= result.scale)


def test_a_system_that_always_fails_has_zero_capacity_and_says_so() -> None:
    """If even the smallest scale misses the goal, capacity is 0 and the result is marked unbracketed."""
    result = find_capacity(lambda s: Probe(s, s, 0.5, None), CapacitySearch(max_probes=20))
    assert result.capacity_rps == 0.0 and not result.bracketed


def test_goal_outside_unit_interval_is_refused() -> None:
    """A goal of 0 or above 1 is a ValueError, not a silent search."""
    with pytest.raises(ValueError, match="goal"):
        find_capacity(_system(1.0), CapacitySearch(goal=1.5))


def test_ideal_prefix_hit_rate_counts_leading_blocks_seen_before() -> None:
    """One infinite cache hits the leading run of blocks an earlier request computed, nothing after a miss."""
    requests = [
        WorkloadRequest("a", 0.0, 1024, 1, hash_ids=(1, 2)),
        WorkloadRequest("b", 1.0, 1536, 1, hash_ids=(1, 2, 3)),   # hits 1, 2 -> 1024 tokens
        WorkloadRequest("c", 2.0, 1024, 1, hash_ids=(9, 2)),      # first block misses -> 0
    ]
    assert ideal_prefix_hit_rate(requests) == pytest.approx(1024 / (1024 + 1536 + 1024))
    assert offered_rate(requests) == pytest.approx(1.0)
