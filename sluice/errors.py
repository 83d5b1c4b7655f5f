"""Domain errors and their one mapping to gRPC statuses.

A caller's mistake or an overload is raised as a `SluiceError` subclass anywhere below a
servicer; `ErrorInterceptor` (one per service) turns it into a precise status with
google.rpc details: `ErrorInfo` (reason + metadata), `BadRequest` (the offending field),
`RetryInfo` (how long to wait). Clients read them back with `details_of()`.

This module imports only grpcio, protobuf and googleapis-common-protos, so the client SDK can
use it without the server dependencies.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from sluice.core_errors import CoreError

DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "sluice"


MAX_MESSAGE_CHARS = 240


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Return `text` cut to `limit` characters, saying how long it was.

    A client's value echoed whole (a 64 KiB request id) made the trailers exceed gRPC's 16 KiB metadata
    limit, and the client saw RESOURCE_EXHAUSTED instead of the error; the message travels twice (the
    status line and its details) and non-ASCII text triples when percent-encoded, hence the margin.
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class SluiceError(Exception):
    """An error with a gRPC status code; `reason` is a stable machine-readable word."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        field_name: str = "",
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or type(self).__name__.upper()
        self.field_name = field_name
        self.metadata = dict(metadata or {})
        self.retry_after_s = retry_after_s

    def to_status(self) -> status_pb2.Status:
        """Return the google.rpc.Status carrying this error's details (long texts clipped, see `clip`)."""
        message = clip(self.message)
        status = status_pb2.Status(code=self.code.value[0], message=message)
        metadata = {clip(k, 64): clip(v, 128) for k, v in self.metadata.items()}
        info = error_details_pb2.ErrorInfo(reason=clip(self.reason, 64), domain=ERROR_DOMAIN, metadata=metadata)
        status.details.add().Pack(info)
        if self.field_name:
            bad = error_details_pb2.BadRequest()
            bad.field_violations.add(field=clip(self.field_name, 128), description=message)
            status.details.add().Pack(bad)
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(max(self.retry_after_s, 0.0) * 1e9))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return status


class InvalidArgument(SluiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SluiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SluiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unauthenticated(SluiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SluiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(SluiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SluiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SluiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPrecondition(SluiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


def from_core_error(exc: CoreError) -> SluiceError:
    """Return the SluiceError for a pure core's refusal: the one place its status name becomes a code."""
    error = SluiceError(exc.detail, reason=exc.reason_word, field_name=exc.field_name, metadata=exc.metadata,
                        retry_after_s=exc.retry_after_s)
    error.code = grpc.StatusCode[exc.status]
    return error


async def abort(context: grpc.aio.ServicerContext, error: SluiceError) -> None:
    """Abort the RPC with `error`'s code, message and details (raises, as context.abort does)."""
    status = error.to_status()
    await context.abort(
        error.code, status.message, trailing_metadata=((DETAILS_KEY, status.SerializeToString()),)
    )


# (RpcMethodHandler attribute, handler factory, whether the behaviour yields a stream, whether the
# request is a stream); Sluice has no client-streaming-only RPCs.
_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True, True),
)
Parse = Callable[[bytes], Any]
Guard = Callable[[Any], None]
Authorize = Callable[[str, Any], None]


def _no_guard(context: Any) -> None:
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SluiceError and the cores' CoreError refusals to statuses for every RPC.

    It also parses request messages itself (the handlers get raw bytes from gRPC), because gRPC
    answers a message that does not parse with UNKNOWN and logs a traceback: here a malformed
    message, or one over `max_message_bytes`, is INVALID_ARGUMENT like any other bad input.
    """

    def __init__(self, max_message_bytes: int | None = None, authorize: Authorize | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.authorize = authorize
        """Called with (full method name, context) before each handler; raises a SluiceError to refuse."""

    def _as_sluice_error(self, exc: BaseException) -> SluiceError | None:
        if isinstance(exc, SluiceError):
            return exc
        return from_core_error(exc) if isinstance(exc, CoreError) else None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        for kind, make_handler, streams, request_streams in _HANDLER_KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                parse = self._parser(handler.request_deserializer, handler_call_details.method)
                guard = self._guard(handler_call_details.method)
                wrap = self._wrap_stream if streams else self._wrap_unary
                return make_handler(wrap(behavior, parse, guard, request_streams), request_deserializer=None,
                                    response_serializer=handler.response_serializer)
        return handler

    def _guard(self, method: Any) -> Guard:
        """Return the per-call check of the caller for `method` (a no-op without `authorize`)."""
        authorize = self.authorize
        if authorize is None:
            return _no_guard
        rpc = method.decode(errors="replace") if isinstance(method, bytes) else str(method)
        return lambda context: authorize(rpc, context)

    def _parser(self, deserializer: Parse | None, method: Any) -> Parse:
        limit = self.max_message_bytes
        rpc = method.decode(errors="replace") if isinstance(method, bytes) else str(method)

        def parse(raw: bytes) -> Any:
            if limit is not None and len(raw) > limit:
                raise InvalidArgument(f"request message is {len(raw)} bytes; the limit is max_message_bytes = "
                                      f"{limit} bytes", reason="message_too_large",
                                      metadata={"limit": "max_message_bytes", "limit_bytes": str(limit)})
            if deserializer is None:
                return raw
            try:
                return deserializer(raw)
            except Exception as exc:  # protobuf's DecodeError, or whatever a custom deserializer raises
                raise InvalidArgument(f"request message of {rpc} does not parse ({type(exc).__name__}: "
                                      f"{str(exc)[:80]})", reason="malformed_message") from None

        return parse

    def _wrap_unary(self, behavior: Callable[..., Any], parse: Parse, guard: Guard,
                    request_streams: bool) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                guard(context)
                return await behavior(parse(request), context)
            except Exception as exc:
                error = self._as_sluice_error(exc)
                if error is None:
                    raise
                await abort(context, error)

        return wrapped

    def _wrap_stream(self, behavior: Callable[..., Any], parse: Parse, guard: Guard,
                     request_streams: bool) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                guard(context)
                result = behavior(_parsed(request, parse) if request_streams else parse(request), context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:
                    await result
            except Exception as exc:
                error = self._as_sluice_error(exc)
                if error is None:
                    raise
                await abort(context, error)

        return wrapped


async def _parsed(requests: AsyncIterator[bytes], parse: Parse) -> AsyncIterator[Any]:
    async for raw in requests:
        yield parse(raw)


@dataclass
class ErrorDetails:
    """What a client learns from a failed call."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    field_name: str = ""
    retry_after_s: float | None = None


def details_of(error: grpc.RpcError) -> ErrorDetails:
    """Return the code, message and google.rpc details of a failed call (sync or aio)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    out = ErrorDetails(code=code, message=message or "")
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key != DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            _read_detail(detail, out)
    return out


def _read_detail(detail: Any, out: ErrorDetails) -> None:
    info = error_details_pb2.ErrorInfo()
    retry = error_details_pb2.RetryInfo()
    bad = error_details_pb2.BadRequest()
    if detail.Unpack(info):
        out.reason = info.reason
        out.metadata = dict(info.metadata)
    elif detail.Unpack(retry):
        out.retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    elif detail.Unpack(bad) and bad.field_violations:
        out.field_name = bad.field_violations[0].field
