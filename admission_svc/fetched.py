"""Completions fetched from a scheduler (Lookup), judged after the fact: late on the bus, or lost on it.

Theory of operation
-------------------
The watchdog asks a quiet request's scheduler about it (`Lookup`); a completion the scheduler still remembers
ends the request at once, as if it had come from the bus. At that moment nobody can tell a completion lost on
the bus from one that is only late: in a fair-share run 65 of 69 fetched completions had their bus copy
arrive shortly after (they ended < 0.2 s before the Lookup), and an age rule at fetch time cannot decide either,
since completions a Redis restart really lost are fetched within 2 s of their end too. So a fetch is
remembered here, not judged, and the bus decides.

Rules
-----
* `fetched` remembers a completion the Lookup supplied while the request still waited for it, by the id of the
  attempt it ends, with the fetch time. A second fetch of the same id keeps the first time.
* `arrived` (the bus copy of a remembered completion reached admission) judges it LATE: the fetch only
  anticipated it. A copy of a completion that is not remembered (never fetched, already judged, or a second
  delivery: the bus delivers at least once) is nothing.
* `overdue` judges LOST every remembered completion whose bus copy has not come within `grace_s` of its fetch.
  Judged at whichever comes first, the copy or the sweep after the grace: a copy that comes after the grace
  but before the sweep is LATE, which is what it was.
* At most `capacity` fetches wait for their copy; one more forgets the oldest as UNRESOLVED (neither called
  lost nor late), so memory stays bounded whatever the rate of fetches.
* Every remembered fetch is judged exactly once: LATE, LOST or UNRESOLVED.

Pure: no clock, no I/O; `now` is an argument (monotonic seconds, never decreasing from call to call).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["FETCH_GRACE_S", "MAX_FETCHES_AWAITED", "FetchOutcome", "FetchVerdict", "FetchedCompletions"]

FETCH_GRACE_S = 30.0
"""Seconds a fetched completion's bus copy may take before the completion counts as lost on the bus. The late
copies measured came shortly after the fetch; a scheduler's publisher holds what it could not send while Redis
was away and sends it once Redis is back, so a copy held up by a Redis stall of a few seconds still counts late."""
MAX_FETCHES_AWAITED = 4096
"""Fetched completions waiting for their bus copy at most (as many as a scheduler remembers for Lookup)."""


class FetchOutcome(enum.Enum):
    """What a fetched completion turned out to be (the `outcome` label of its metric)."""

    LATE = "late"
    """Its bus copy came after the fetch: nothing was lost."""
    LOST = "lost"
    """No bus copy within the grace: the fetch recovered a completion lost on the bus."""
    UNRESOLVED = "unresolved"
    """Forgotten before either: more than `capacity` fetches were waiting."""


@dataclass(frozen=True, slots=True)
class FetchVerdict:
    """One fetched completion, judged."""

    attempt_id: str
    """The id the completion carries (the attempt it ended)."""
    request_id: str
    """The request that attempt belongs to."""
    outcome: FetchOutcome
    since_fetch_s: float
    """Seconds from the fetch to the verdict."""


@dataclass(slots=True)
class _Fetch:
    request_id: str
    fetched_at: float


class FetchedCompletions:
    """Fetched completions waiting for their bus copy, oldest fetch first (see the module docstring)."""

    def __init__(self, grace_s: float = FETCH_GRACE_S, capacity: int = MAX_FETCHES_AWAITED) -> None:
        """Raises ValueError for a grace that is not positive or a capacity under 1."""
        if not grace_s > 0 or capacity < 1:
            raise ValueError(f"grace_s must be positive and capacity at least 1, got {grace_s} and {capacity}")
        self.grace_s = grace_s
        self.capacity = capacity
        self._awaited: OrderedDict[str, _Fetch] = OrderedDict()

    def __len__(self) -> int:
        return len(self._awaited)

    def fetched(self, attempt_id: str, request_id: str, now: float) -> list[FetchVerdict]:
        """Remember a fetched completion; returns the verdicts (UNRESOLVED) of those forgotten to make room."""
        if attempt_id in self._awaited:
            return []
        self._awaited[attempt_id] = _Fetch(request_id, now)
        forgotten = []
        while len(self._awaited) > self.capacity:
            oldest_id, oldest = self._awaited.popitem(last=False)
            forgotten.append(FetchVerdict(oldest_id, oldest.request_id, FetchOutcome.UNRESOLVED,
                                          now - oldest.fetched_at))
        return forgotten

    def arrived(self, attempt_id: str, now: float) -> FetchVerdict | None:
        """The bus copy of `attempt_id`'s completion came: returns its LATE verdict, or None when that completion
        was not waiting (never fetched, or already judged)."""
        fetch = self._awaited.pop(attempt_id, None)
        if fetch is None:
            return None
        return FetchVerdict(attempt_id, fetch.request_id, FetchOutcome.LATE, now - fetch.fetched_at)

    def overdue(self, now: float) -> list[FetchVerdict]:
        """Return the LOST verdicts of the completions whose bus copy has not come within the grace, oldest
        first, and forget them."""
        lost = []
        limit = now - self.grace_s
        while self._awaited:
            attempt_id, fetch = next(iter(self._awaited.items()))
            if fetch.fetched_at > limit:
                break
            del self._awaited[attempt_id]
            lost.append(FetchVerdict(attempt_id, fetch.request_id, FetchOutcome.LOST, now - fetch.fetched_at))
        return lost
