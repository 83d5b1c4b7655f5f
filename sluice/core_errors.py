"""One translation of the pure cores' refusals into gRPC-mapped SluiceErrors.

The cores raise plain exceptions (they must not import grpc); every service installs
`ErrorInterceptor(translate_core_error)` so the mapping lives here once.
"""

from __future__ import annotations

from admission_svc.core import DuplicateRequest, InvalidRequest, OverBudget, UnknownApiKey
from router_svc.core import IllegalReplicaTransition, NoReplicaAvailable, UnknownModel, UnknownReplica
from scheduler_svc.core.types import RejectReason, RequestRejected
from sluice import errors


def translate_core_error(exc: BaseException) -> errors.SluiceError | None:
    """Return the SluiceError for a core exception, or None for anything else (a real bug)."""
    if isinstance(exc, UnknownApiKey):
        return errors.Unauthenticated(str(exc), reason=exc.reason)
    if isinstance(exc, InvalidRequest):
        return errors.InvalidArgument(exc.detail, reason=exc.reason, field_name=exc.field)
    if isinstance(exc, OverBudget):
        return errors.ResourceExhausted(exc.detail, reason="over_budget", metadata={"budget": exc.budget},
                                        retry_after_s=exc.retry_after_s)
    if isinstance(exc, DuplicateRequest):
        return errors.AlreadyExists(str(exc), reason=exc.reason)
    if isinstance(exc, UnknownModel):
        return errors.NotFound(str(exc), reason="unknown_model")
    if isinstance(exc, NoReplicaAvailable):
        return errors.Unavailable(str(exc), reason="no_ready_replica", retry_after_s=1.0)
    if isinstance(exc, UnknownReplica):
        return errors.NotFound(str(exc), reason="unknown_replica")
    if isinstance(exc, IllegalReplicaTransition):
        return errors.FailedPrecondition(str(exc), reason="illegal_replica_transition")
    if isinstance(exc, RequestRejected):
        return _rejected(exc)
    return None


def _rejected(exc: RequestRejected) -> errors.SluiceError:
    metadata = {"reject_reason": exc.reason.value}
    if exc.reason is RejectReason.QUEUE_FULL:
        return errors.ResourceExhausted(exc.detail, reason="queue_full", metadata=metadata, retry_after_s=0.5)
    if exc.reason is RejectReason.DUPLICATE:
        return errors.AlreadyExists(exc.detail, reason="duplicate_request", metadata=metadata)
    return errors.InvalidArgument(exc.detail, reason=exc.reason.value, metadata=metadata)
