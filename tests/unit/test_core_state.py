"""The request state machine: every (status, input) pair, legal or not."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from scheduler_svc.core.state import TRANSITIONS, IllegalTransition, Input, apply, next_status
from sluice.types import TERMINAL_STATUSES, RequestStatus


@dataclass
class _Req:
    request_id: str
    status: RequestStatus
    epoch: int = 0


@pytest.mark.parametrize(("status", "event"), list(itertools.product(RequestStatus, Input)))
def test_every_status_input_pair(status: RequestStatus, event: Input) -> None:
    """A legal pair moves to the table's status; an illegal one raises and leaves the request unchanged."""
    request = _Req("r", status, epoch=3)
    expected = TRANSITIONS.get((status, event))
    if expected is None:
        with pytest.raises(IllegalTransition):
            apply(request, event)
        assert (request.status, request.epoch) == (status, 3)
    else:
        assert apply(request, event) is expected is request.status
        assert request.epoch == (4 if event is Input.PREEMPT else 3)


def test_terminal_statuses_have_no_way_out() -> None:
    """Terminal statuses accept no input, so a request enters a terminal status exactly once."""
    for status, event in itertools.product(TERMINAL_STATUSES, Input):
        assert next_status(status, event) is None


def test_documented_lifecycle_is_reachable() -> None:
    """WAITING -> RUNNING -> PREEMPTED -> WAITING -> RUNNING -> CANCELLING -> TIMED_OUT walks the table."""
    request = _Req("r", RequestStatus.WAITING)
    path = [Input.SCHEDULE, Input.PREEMPT, Input.REQUEUE, Input.SCHEDULE, Input.TIMEOUT_DEFERRED]
    for event in path:
        apply(request, event)
    assert (request.status, request.epoch) == (RequestStatus.CANCELLING, 1)
    assert apply(request, Input.RELEASE_TIMED_OUT) is RequestStatus.TIMED_OUT


def test_rejected_is_never_entered_by_the_core() -> None:
    """REJECTED belongs to admission: no transition of the core leads there."""
    assert RequestStatus.REJECTED not in TRANSITIONS.values()
