"""The request table: every live request by id, where it is, and what became of the ended ones.

A live request is in exactly one place: the waiting queue (status WAITING, held by the backlog),
`running` (RUNNING), `swapping` (PREEMPTED while a swap-out copy is in flight) or `cancelling`
(CANCELLING until the round that reads it answers). `live` holds all of them by id. An ended
request leaves `live` and is remembered by id and status for a while (`TERMINAL_MEMORY` ids), so a
late cancel or status query gets an answer.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler_svc.core.request import Request
from sluice.types import RequestStatus

TERMINAL_MEMORY = 65536
"""How many ended request ids `cancel` and `request_status` still recognise."""


class RequestTable:
    """Live requests by id and place, the statuses of recently ended ones, and counts by status."""

    __slots__ = ("live", "running", "swapping", "cancelling", "_terminal", "_counts", "_next_arrival_seq")

    def __init__(self) -> None:
        self.live: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        """RUNNING requests in the order they (re)started: the round builder's decode order."""
        self.swapping: dict[str, Request] = {}
        self.cancelling: dict[str, Request] = {}
        self._terminal: OrderedDict[str, RequestStatus] = OrderedDict()
        self._counts: dict[RequestStatus, int] = {}
        self._next_arrival_seq = 0

    def next_arrival_seq(self) -> int:
        """Return the arrival sequence number the next submitted request gets (not yet taken)."""
        return self._next_arrival_seq + 1

    def add(self, request: Request) -> None:
        """Enter a newly submitted request (its arrival_seq from `next_arrival_seq`)."""
        self._next_arrival_seq = request.arrival_seq
        self.live[request.request_id] = request

    def forget(self, request: Request, status: RequestStatus) -> None:
        """Drop an ended request from `live`, remembering its terminal `status`."""
        del self.live[request.request_id]
        terminal = self._terminal
        terminal[request.request_id] = status
        if len(terminal) > TERMINAL_MEMORY:
            terminal.popitem(last=False)
        self._counts[status] = self._counts.get(status, 0) + 1

    def status(self, request_id: str) -> RequestStatus | None:
        """Return a request's status, or None for an id the table does not know (or has forgotten)."""
        request = self.live.get(request_id)
        return request.status if request is not None else self._terminal.get(request_id)

    def ended_status(self, request_id: str) -> RequestStatus | None:
        """Return the remembered terminal status of an ended request, or None."""
        return self._terminal.get(request_id)

    @property
    def ended_counts(self) -> dict[RequestStatus, int]:
        """Return how many requests ended with each terminal status (absent: none); do not modify."""
        return self._counts

    def count(self, *statuses: RequestStatus) -> int:
        """Return how many requests ended with any of `statuses`."""
        return sum(self._counts.get(status, 0) for status in statuses)
