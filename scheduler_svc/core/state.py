"""The request state machine, as data.

Theory of operation
-------------------
A request's status changes only through `apply(request, Input.X)`. The table `TRANSITIONS` maps
(status, input) to the next status; a pair that is not in the table is illegal and raises
`IllegalTransition` without touching the request. Terminal statuses have no outgoing edges, so a
terminal status is entered exactly once. `epoch` counts preemptions: it increments on PREEMPT, and
round results carrying an older epoch are stale.

    WAITING --SCHEDULE--> RUNNING --PREEMPT--> PREEMPTED --REQUEUE--> WAITING ...
    RUNNING --STOP / LENGTH / FAIL--> FINISHED_STOP / FINISHED_LENGTH / FAILED
    WAITING | PREEMPTED | RUNNING --CANCEL / TIMEOUT--> CANCELLED / TIMED_OUT   (released at once)
    RUNNING | PREEMPTED --CANCEL_DEFERRED / TIMEOUT_DEFERRED--> CANCELLING      (a round still reads it)
    CANCELLING --RELEASE_CANCELLED / RELEASE_TIMED_OUT--> CANCELLED / TIMED_OUT (that round's result)

REJECTED belongs to admission: the core refuses a submission by raising, so nothing enters it here.
"""

from __future__ import annotations

import enum
from typing import Protocol

from sluice.types import RequestStatus


class Input(enum.Enum):
    """Everything that can happen to a request."""

    SCHEDULE = "schedule"
    PREEMPT = "preempt"
    REQUEUE = "requeue"
    STOP = "stop"
    LENGTH = "length"
    FAIL = "fail"
    CANCEL = "cancel"
    TIMEOUT = "timeout"
    CANCEL_DEFERRED = "cancel_deferred"
    TIMEOUT_DEFERRED = "timeout_deferred"
    RELEASE_CANCELLED = "release_cancelled"
    RELEASE_TIMED_OUT = "release_timed_out"


S = RequestStatus
TRANSITIONS: dict[tuple[RequestStatus, Input], RequestStatus] = {
    (S.WAITING, Input.SCHEDULE): S.RUNNING,
    (S.WAITING, Input.CANCEL): S.CANCELLED,
    (S.WAITING, Input.TIMEOUT): S.TIMED_OUT,
    (S.RUNNING, Input.PREEMPT): S.PREEMPTED,
    (S.RUNNING, Input.STOP): S.FINISHED_STOP,
    (S.RUNNING, Input.LENGTH): S.FINISHED_LENGTH,
    (S.RUNNING, Input.FAIL): S.FAILED,
    (S.RUNNING, Input.CANCEL): S.CANCELLED,
    (S.RUNNING, Input.TIMEOUT): S.TIMED_OUT,
    (S.RUNNING, Input.CANCEL_DEFERRED): S.CANCELLING,
    (S.RUNNING, Input.TIMEOUT_DEFERRED): S.CANCELLING,
    (S.PREEMPTED, Input.REQUEUE): S.WAITING,
    (S.PREEMPTED, Input.CANCEL): S.CANCELLED,
    (S.PREEMPTED, Input.TIMEOUT): S.TIMED_OUT,
    # A swap-out copy of a preempted request is still in flight: release after that round.
    (S.PREEMPTED, Input.CANCEL_DEFERRED): S.CANCELLING,
    (S.PREEMPTED, Input.TIMEOUT_DEFERRED): S.CANCELLING,
    (S.CANCELLING, Input.RELEASE_CANCELLED): S.CANCELLED,
    (S.CANCELLING, Input.RELEASE_TIMED_OUT): S.TIMED_OUT,
}
del S


class IllegalTransition(Exception):
    """An input that the request's current status does not accept; nothing changed."""

    def __init__(self, request_id: str, status: RequestStatus, event: Input) -> None:
        super().__init__(f"request {request_id!r}: {event.value!r} is illegal in status {status.value!r}")
        self.request_id = request_id
        self.status = status
        self.event = event


class HasStatus(Protocol):
    request_id: str
    status: RequestStatus
    epoch: int


def next_status(status: RequestStatus, event: Input) -> RequestStatus | None:
    """Return the status that `event` leads to from `status`, or None when it is illegal."""
    return TRANSITIONS.get((status, event))


def apply(request: HasStatus, event: Input) -> RequestStatus:
    """Move `request` along the table and return its new status.

    Raises IllegalTransition (and changes nothing) when the pair is not in the table.
    """
    new = TRANSITIONS.get((request.status, event))
    if new is None:
        raise IllegalTransition(request.request_id, request.status, event)
    request.status = new
    if event is Input.PREEMPT:
        request.epoch += 1
    return new
