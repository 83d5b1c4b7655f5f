"""Queue and total deadlines of live requests: one heap with lazy deletion.

An entry is (when, arrival_seq * 2 + kind, kind, request). It is live while its request is live
and not CANCELLING, and, for a queue deadline, not yet scheduled. Entries of ended requests stay
until they surface or until the heap has doubled, when one O(n) pass drops them, so the cost per
submission stays O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from scheduler_svc.core.request import Request
from scheduler_svc.core.table import RequestTable
from sluice.types import RequestStatus

QUEUE_DEADLINE = 0
TOTAL_DEADLINE = 1


class DeadlineHeap:
    """The earliest pending queue or total deadline first, for the requests of one table."""

    __slots__ = ("_table", "_heap", "_compact_at")

    def __init__(self, table: RequestTable) -> None:
        self._table = table
        self._heap: list[tuple[float, int, int, Request]] = []
        self._compact_at = 1024

    def __len__(self) -> int:
        """Return the number of entries, dead ones included (they are dropped lazily)."""
        return len(self._heap)

    def push(self, when: float, kind: int, request: Request) -> None:
        """Add a QUEUE_DEADLINE or TOTAL_DEADLINE of `request` at time `when`."""
        heap = self._heap
        if len(heap) >= self._compact_at:
            heap[:] = [entry for entry in heap if self._is_live(entry[2], entry[3])]
            heapq.heapify(heap)
            self._compact_at = max(1024, 2 * len(heap))
        heapq.heappush(heap, (when, request.arrival_seq * 2 + kind, kind, request))

    def expired(self, now: float) -> Iterator[Request]:
        """Pop and yield each request with a live deadline <= now (earliest first)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, kind, request = heapq.heappop(heap)
            if self._is_live(kind, request):
                yield request

    def next(self) -> float | None:
        """Return the earliest live deadline, or None when there is none."""
        heap = self._heap
        while heap and not self._is_live(heap[0][2], heap[0][3]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _is_live(self, kind: int, request: Request) -> bool:
        if self._table.live.get(request.request_id) is not request:
            return False
        if request.status is RequestStatus.CANCELLING:
            return False
        return kind == TOTAL_DEADLINE or request.first_scheduled_time is None
