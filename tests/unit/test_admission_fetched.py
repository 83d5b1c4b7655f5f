"""The ledger of completions fetched by Lookup (admission_svc/fetched.py): late, lost or unresolved, judged once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from admission_svc.fetched import FetchedCompletions, FetchOutcome, FetchVerdict


def make_ledger(grace_s: float = 30.0, capacity: int = 4096) -> FetchedCompletions:
    return FetchedCompletions(grace_s, capacity)


def test_a_bus_copy_after_the_fetch_judges_the_completion_late_once() -> None:
    """The bus copy of a fetched completion makes it LATE with the seconds since the fetch; a second copy (the bus
    delivers at least once) and the sweep after the grace find nothing more to judge."""
    ledger = make_ledger()
    assert ledger.fetched("r1#1", "r1", 100.0) == []
    assert ledger.arrived("r1#1", 100.25) == FetchVerdict("r1#1", "r1", FetchOutcome.LATE, 0.25)
    assert ledger.arrived("r1#1", 100.5) is None
    assert ledger.overdue(1000.0) == []
    assert len(ledger) == 0


def test_no_bus_copy_within_the_grace_judges_the_completion_lost_and_not_before() -> None:
    """A fetched completion stays unjudged until the grace has passed since its fetch, then is LOST (oldest first);
    a bus copy coming after that verdict changes nothing."""
    ledger = make_ledger(grace_s=2.0)
    ledger.fetched("a", "a", 10.0)
    ledger.fetched("b", "b", 11.0)
    assert ledger.overdue(11.9) == []
    assert ledger.overdue(12.0) == [FetchVerdict("a", "a", FetchOutcome.LOST, 2.0)]
    assert ledger.overdue(13.5) == [FetchVerdict("b", "b", FetchOutcome.LOST, 2.5)]
    assert ledger.arrived("a", 14.0) is None


def test_a_copy_that_is_never_fetched_is_nothing() -> None:
    """The bus copies of completions nobody fetched (nearly all of them) are not judged."""
    ledger = make_ledger()
    assert ledger.arrived("never-fetched", 5.0) is None
    assert len(ledger) == 0


def test_a_second_fetch_keeps_the_first_fetch_time() -> None:
    """Fetched twice (two ticks before the request ended), a completion is judged from its first fetch."""
    ledger = make_ledger(grace_s=1.0)
    ledger.fetched("a", "a", 1.0)
    ledger.fetched("a", "a", 1.5)
    assert ledger.overdue(2.0) == [FetchVerdict("a", "a", FetchOutcome.LOST, 1.0)]


def test_beyond_the_capacity_the_oldest_fetch_is_forgotten_unresolved() -> None:
    """With `capacity` fetches waiting, one more forgets the oldest, judged UNRESOLVED (neither lost nor late);
    its bus copy then finds nothing, and the ledger never holds more than `capacity`."""
    ledger = make_ledger(capacity=3)
    for i in range(3):
        assert ledger.fetched(f"r{i}", f"r{i}", float(i)) == []
    assert ledger.fetched("r3", "r3", 3.5) == [FetchVerdict("r0", "r0", FetchOutcome.UNRESOLVED, 3.5)]
    assert len(ledger) == 3
    assert ledger.arrived("r0", 4.0) is None
    assert ledger.arrived("r1", 4.0) == FetchVerdict("r1", "r1", FetchOutcome.LATE, 3.0)


@pytest.mark.parametrize(("grace_s", "capacity"), [(0.0, 1), (-1.0, 1), (float("nan"), 1), (1.0, 0)])
def test_a_grace_that_is_not_positive_or_a_capacity_under_one_is_refused(grace_s: float, capacity: int) -> None:
    """The ledger refuses settings that would judge every fetch at once or remember none."""
    with pytest.raises(ValueError, match="grace_s"):
        FetchedCompletions(grace_s, capacity)


_steps = st.lists(st.tuples(st.sampled_from(["fetch", "arrive", "sweep"]), st.integers(0, 11),
                            st.floats(0.0, 3.0)), max_size=120)


@settings(max_examples=200, deadline=None)
@given(steps=_steps, capacity=st.integers(1, 5))
def test_every_fetch_is_judged_once_and_the_ledger_stays_bounded(
        steps: list[tuple[str, int, float]], capacity: int) -> None:
    """Whatever the order of fetches, bus copies and sweeps: the ledger never holds more than `capacity`, every
    verdict is of a fetch still waiting (never twice), a LOST one waited at least the grace, and after a last sweep
    past every grace each fetch has exactly one verdict."""
    grace_s = 2.0
    ledger, now = make_ledger(grace_s, capacity), 0.0
    waiting: set[str] = set()
    fetched = judged = 0
    for action, key, advance in steps:
        now += advance
        attempt = f"a{key}"
        if action == "fetch":
            fetched += attempt not in waiting
            verdicts = ledger.fetched(attempt, attempt, now)
            waiting.add(attempt)
        elif action == "arrive":
            verdict = ledger.arrived(attempt, now)
            verdicts = [] if verdict is None else [verdict]
        else:
            verdicts = ledger.overdue(now)
        for verdict in verdicts:
            assert verdict.attempt_id in waiting
            waiting.discard(verdict.attempt_id)
            assert verdict.outcome is not FetchOutcome.LOST or verdict.since_fetch_s >= grace_s
        judged += len(verdicts)
        assert len(ledger) == len(waiting) <= capacity
    judged += len(ledger.overdue(now + grace_s + 1.0))
    assert judged == fetched and len(ledger) == 0
