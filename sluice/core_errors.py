"""The refusals of the pure cores, each with the status it maps to: one table, no grpc.

The cores (admission, router, scheduler, planner) raise these; they must not import grpc, so a
refusal carries its status as a name (``"INVALID_ARGUMENT"``) and `sluice.errors` turns it into
a `SluiceError` with google.rpc details in exactly one place (`errors.from_core_error`), which
every service's `ErrorInterceptor` applies. Adding a refusal means adding a class here: its
status, its stable `reason` word, and what it tells the caller (field, metadata, retry delay).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: types.py imports nothing from here
    from sluice.types import RejectReason


class CoreError(Exception):
    """A refusal of a pure core; `status` is a gRPC status name, `reason` a stable word."""

    status = "INTERNAL"
    reason = "core_error"

    def __init__(
        self,
        detail: str,
        *,
        field_name: str = "",
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field_name = field_name
        self.metadata = dict(metadata or {})
        self.retry_after_s = retry_after_s

    @property
    def reason_word(self) -> str:
        """The stable word for error details and metrics."""
        return str(self.reason)


# --- admission ---------------------------------------------------------------------------------


class UnknownApiKey(CoreError):
    status = "UNAUTHENTICATED"
    reason = "bad_api_key"


class InvalidRequest(CoreError):
    """The request itself is wrong; `field` names the offending field."""

    status = "INVALID_ARGUMENT"
    reason = "invalid_request"

    def __init__(self, field_name: str, detail: str) -> None:
        super().__init__(detail, field_name=field_name)

    @property
    def field(self) -> str:
        return self.field_name


class OverBudget(CoreError):
    """No room now; retry after `retry_after_s`."""

    status = "RESOURCE_EXHAUSTED"
    reason = "over_budget"

    def __init__(self, budget: str, retry_after_s: float, detail: str) -> None:
        super().__init__(detail, metadata={"budget": budget}, retry_after_s=retry_after_s)
        self.budget = budget


class DuplicateRequest(CoreError):
    status = "ALREADY_EXISTS"
    reason = "duplicate_request"


class PromptTooLarge(CoreError):
    """The prompt is over the byte limit; refused before it is tokenized (no work spent on it)."""

    status = "INVALID_ARGUMENT"
    reason = "prompt_too_large"

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"prompt is {size_bytes} bytes; the limit is max_prompt_bytes = {limit_bytes} bytes",
                         field_name="prompt", metadata={"limit": "max_prompt_bytes", "limit_bytes": str(limit_bytes)})


# --- a request that ended without finishing -------------------------------------------------------
# Its stream ends with one of these instead of a final chunk, raised like any other refusal so the
# one interceptor gives it its status and details (a REJECTED request's RetryInfo included).


class RequestEnded(CoreError):
    """A request reached a terminal status other than FINISHED_STOP or FINISHED_LENGTH."""


class RequestCancelled(RequestEnded):
    status = "CANCELLED"
    reason = "request_cancelled"


class RequestTimedOut(RequestEnded):
    status = "DEADLINE_EXCEEDED"
    reason = "request_timed_out"


class RequestFailed(RequestEnded):
    status = "INTERNAL"
    reason = "request_failed"


class RequestLost(RequestEnded):
    """Ended FAILED by admission because its replicas were lost (killed, drained away, refusing its decode half)
    more times than admission moves a request, or with no replica left to take it: the fleet failed it, not the
    request nor a bug, so a later retry may succeed."""

    status = "UNAVAILABLE"
    reason = "request_lost"


class RequestNotPlaced(RequestEnded):
    """Admitted but could not be placed on a replica (REJECTED): a later retry may be."""

    status = "UNAVAILABLE"
    reason = "request_not_placed"


# Terminal request status name -> the refusal its stream ends with (finished ones end normally).
_ENDED: dict[str, type[RequestEnded]] = {
    "CANCELLED": RequestCancelled,
    "TIMED_OUT": RequestTimedOut,
    "FAILED": RequestFailed,
    "REJECTED": RequestNotPlaced,
}
FAILURE_STATUSES = frozenset(_ENDED)
"""Terminal request status names that end a stream with a refusal."""
NOT_PLACED_RETRY_AFTER_S = 1.0
"""Retry delay of a REJECTED request when the refusal that ended it named none."""


def ended_error(status_name: str, detail: str, retry_after_s: float | None = None,
                lost: bool = False) -> RequestEnded | None:
    """Return the refusal a request's terminal status `status_name` ends its stream with, or None when the
    status is not a failure (finished, or not terminal). `lost`: admission ended it FAILED because the fleet lost
    it (`RequestLost`, UNAVAILABLE). A REJECTED or lost one always carries a retry delay."""
    kind = _ENDED.get(status_name)
    if kind is None:
        return None
    if kind is RequestFailed and lost:
        kind = RequestLost
    if kind in (RequestNotPlaced, RequestLost) and retry_after_s is None:
        retry_after_s = NOT_PLACED_RETRY_AFTER_S
    return kind(detail, metadata={"request_status": status_name}, retry_after_s=retry_after_s)


# --- router ------------------------------------------------------------------------------------


class UnknownModel(CoreError):
    """No replica, in any state, serves this model and adapter version."""

    status = "NOT_FOUND"
    reason = "unknown_model"


class NoReplicaAvailable(CoreError):
    """Replicas of the model exist but none is READY."""

    status = "UNAVAILABLE"
    reason = "no_ready_replica"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, retry_after_s=1.0)


class UnknownReplica(CoreError):
    status = "NOT_FOUND"
    reason = "unknown_replica"


class IllegalReplicaTransition(CoreError):
    status = "FAILED_PRECONDITION"
    reason = "illegal_replica_transition"

    def __init__(self, replica_id: str, state: object, event: object) -> None:
        super().__init__(f"replica {replica_id!r}: {_value(event)} is not allowed in state {_value(state)}")
        self.state = state
        self.event = event


# --- scheduler ---------------------------------------------------------------------------------

# RejectReason value -> (status, reason word, retry delay). NEVER_FITS and INVALID are the
# caller's mistake; QUEUE_FULL passes; DUPLICATE names a live request.
_REJECTION_STATUS: dict[str, tuple[str, str, float | None]] = {
    "queue_full": ("RESOURCE_EXHAUSTED", "queue_full", 0.5),
    "duplicate": ("ALREADY_EXISTS", "duplicate_request", None),
    "never_fits": ("INVALID_ARGUMENT", "never_fits", None),
    "invalid": ("INVALID_ARGUMENT", "invalid", None),
}


class RequestRejected(CoreError):
    """Raised by `SchedulerCore.submit`; nothing about the core changed. `reason` is the RejectReason."""

    reason: RejectReason  # type: ignore[assignment]

    def __init__(self, request_id: str, reason: RejectReason, detail: str) -> None:
        status, word, retry_after_s = _REJECTION_STATUS[reason.value]
        super().__init__(detail, metadata={"reject_reason": reason.value}, retry_after_s=retry_after_s)
        self.args = (f"request {request_id!r} rejected ({reason.value}): {detail}",)
        self.request_id = request_id
        self.reason = reason
        self.status = status
        self._word = word

    @property
    def reason_word(self) -> str:
        return self._word


def _value(item: object) -> str:
    return str(getattr(item, "value", item))
