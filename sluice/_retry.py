"""Typed errors and the retry policy of the client SDK (sluice/client.py).

Only grpcio, protobuf, googleapis-common-protos and tenacity are imported here: the SDK must
work with `pip install sluice[client]`.

Retries follow three rules, each there because the opposite hurts an overloaded server:
- full-jitter exponential backoff, but never sooner than the server's RetryInfo delay;
- a retry budget (token bucket): every call deposits `ratio` tokens, every retry made spends one,
  so retries stay under ~10% of calls and an overload does not turn into a retry storm;
- a Generate is retried only with an idempotency key (the SDK makes one per call), so a
  retry attaches to the same request instead of running it twice.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"


class SluiceError(Exception):
    """An RPC failed; carries the gRPC code, the server's message and its retry delay (if any)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_delay_s: float | None = None,
                 details: tuple[Any, ...] = ()) -> None:
        super().__init__(f"{code.name}: {message}" + (f" (retry after {retry_delay_s:.3f}s)"
                                                       if retry_delay_s is not None else ""))
        self.code = code
        self.message = message
        self.retry_delay_s = retry_delay_s
        self.details = details

    @property
    def retryable(self) -> bool:
        """True when the same call may succeed later (overload or no replica right now)."""
        return self.code in RETRYABLE_CODES


class InvalidArgument(SluiceError):
    """The request itself is wrong (too long, empty, bad sampling value); retrying will not help."""


class Unauthenticated(SluiceError):
    """The API key is missing or unknown."""


class PermissionDenied(SluiceError):
    """The key is valid but may not do this."""


class NotFound(SluiceError):
    """Unknown model, or unknown request id (another tenant's requests look unknown too)."""


class ResourceExhausted(SluiceError):
    """Over a budget; `retry_delay_s` says when to try again."""


class Unavailable(SluiceError):
    """No ready replica or the server is unreachable; transient."""


class DeadlineExceeded(SluiceError):
    """The call's deadline (`timeout=`) passed."""


class Cancelled(SluiceError):
    """The request was cancelled (by `cancel()` or by the server)."""


RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
_BY_CODE: dict[grpc.StatusCode, type[SluiceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def _details(trailing: Any) -> tuple[float | None, tuple[Any, ...]]:
    """Return (retry delay, unpacked google.rpc details) from trailing metadata."""
    raw = next((value for key, value in (trailing or ()) if key == _DETAILS_KEY), None)
    if raw is None:
        return None, ()
    status = status_pb2.Status.FromString(raw)
    delay: float | None = None
    unpacked: list[Any] = []
    for any_detail in status.details:
        for message_type in (error_details_pb2.RetryInfo, error_details_pb2.BadRequest,
                             error_details_pb2.ErrorInfo, error_details_pb2.QuotaFailure,
                             error_details_pb2.ResourceInfo, error_details_pb2.PreconditionFailure):
            if any_detail.Is(message_type.DESCRIPTOR):
                message = message_type()
                any_detail.Unpack(message)
                unpacked.append(message)
                if isinstance(message, error_details_pb2.RetryInfo):
                    delay = message.retry_delay.seconds + message.retry_delay.nanos / 1e9
    return delay, tuple(unpacked)


def error_from_rpc(exc: grpc.RpcError) -> SluiceError:
    """Return the typed SluiceError for a failed RPC (sync or asyncio), details unpacked."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    message = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    trailing = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else ()
    delay, details = _details(trailing)
    return _BY_CODE.get(code, SluiceError)(code, message or "", delay, details)


class RetryBudget:
    """Token bucket bounding retries to about `ratio` of calls (plus a small reserve).

    Thread-safe; shared by every call of one client.
    """

    def __init__(self, ratio: float = 0.1, reserve: float = 3.0, cap: float = 10.0) -> None:
        self._ratio = ratio
        self._cap = cap
        self._balance = reserve
        self._lock = threading.Lock()

    def on_call(self) -> None:
        """Deposit `ratio` tokens for one new call."""
        with self._lock:
            self._balance = min(self._cap, self._balance + self._ratio)

    def try_spend(self) -> bool:
        """Return True (and spend a token) if a retry is allowed now."""
        with self._lock:
            if self._balance >= 1.0:
                self._balance -= 1.0
                return True
            return False

    @property
    def balance(self) -> float:
        """Tokens available now."""
        return self._balance


@dataclass(frozen=True)
class RetryPolicy:
    """How the SDK retries a failed call."""

    max_attempts: int = 4
    """Attempts in total, the first included."""
    initial_backoff_s: float = 0.05
    """Upper bound of the first jittered wait."""
    max_backoff_s: float = 5.0
    """Upper bound of any jittered wait (RetryInfo may ask for longer; it is honoured)."""
    budget_ratio: float = 0.1
    """Retries allowed per call, in the long run."""


def full_jitter_wait(policy: RetryPolicy, rng: random.Random | None = None) -> Callable[[Any], float]:
    """Return a tenacity wait: uniform(0, min(max, initial * 2^n)), at least the server's RetryInfo."""
    rng = rng or random.Random()

    def wait(retry_state: Any) -> float:
        attempt = max(0, retry_state.attempt_number - 1)
        ceiling = min(policy.max_backoff_s, policy.initial_backoff_s * (2 ** attempt))
        jittered = rng.uniform(0.0, ceiling)
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        server_delay = exc.retry_delay_s if isinstance(exc, SluiceError) and exc.retry_delay_s else 0.0
        return max(jittered, server_delay)

    return wait
