"""The Sluice client SDK: `Client` (blocking) and `AsyncClient` (asyncio).

Needs only grpcio, protobuf, googleapis-common-protos and tenacity (`pip install sluice[client]`).

    with Client("localhost:50051", api_key="sk-sluice-local") as client:
        for chunk in client.generate("Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)
        result = client.generate_text("Hello", max_tokens=32, timeout=10)

Errors are raised as typed exceptions (sluice._retry: InvalidArgument, ResourceExhausted, ...)
carrying the gRPC code, the server's message and its retry delay. Retries: see sluice/_retry.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import tenacity

from sluice._retry import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RetryBudget,
    RetryPolicy,
    SluiceError,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
    full_jitter_wait,
)
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2

__all__ = [
    "AsyncClient", "Cancelled", "Chunk", "Client", "DeadlineExceeded", "Generation", "InvalidArgument",
    "NotFound", "PermissionDenied", "RequestInfo", "ResourceExhausted", "RetryBudget", "RetryPolicy", "SluiceError",
    "Unauthenticated", "Unavailable", "Usage",
]

DEFAULT_TARGET = "localhost:50051"
_STATUS_DETAILS = "grpc-status-details-bin"
"""The trailer that carries a google.rpc.Status: admission sends it with every refusal and every ended request."""
DROPPED_RETRY_S = 1.0
"""Retry delay the SDK gives a call gRPC's transport dropped before admission answered it (`_opening_error`)."""


def _opening_error(exc: grpc.RpcError) -> SluiceError:
    """Return the error of a Generate call that failed before its first chunk.

    A CANCELLED that carries none of the server's status details (every refusal and every ended request from
    admission carries them) is not admission's answer: the server's gRPC transport cancelled a call admission's
    handlers never saw (measured under 3x overload: docs/operations.md, "Overload"). Nothing was streamed, so it
    is reported as what it is for the caller, Unavailable (retryable) with a retry delay, instead of a bare
    CANCELLED that reads as if someone had cancelled the request."""
    error = error_from_rpc(exc)
    trailing = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else ()
    if error.code is grpc.StatusCode.CANCELLED and not any(key == _STATUS_DETAILS for key, _ in trailing or ()):
        return Unavailable(grpc.StatusCode.UNAVAILABLE, "the server's gRPC transport cancelled the call before "
                           f"admission answered it (overload; was: {error.message}); nothing was streamed",
                           DROPPED_RETRY_S)
    return error


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part of a streamed answer; `received_s` is time.time() when the client got it."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str
    status: str
    usage: Usage | None
    received_s: float
    created_unix_s: float = 0.0
    """When the server says token_ids[0] was created (time.time() clock); 0 = unknown."""


@dataclass(frozen=True)
class Generation:
    """A whole answer (`generate_text`)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    status: str
    usage: Usage


@dataclass(frozen=True)
class RequestInfo:
    """What admission knows of one request (`get_request`)."""

    request_id: str
    status: str
    """The lifecycle status: WAITING, RUNNING, FINISHED_STOP, FINISHED_LENGTH, CANCELLED, TIMED_OUT, ..."""
    finish_reason: str
    replica_id: str
    usage: Usage
    timestamps: dict[str, float]
    """Unix time of each lifecycle stage seen so far (received, admitted, routed, first_token, ...)."""

    @property
    def finished(self) -> bool:
        """True once the request is in a terminal status."""
        return self.status not in ("WAITING", "RUNNING", "PREEMPTED", "CANCELLING", "REQUEST_STATUS_UNSPECIFIED")


def _request_info(message: admission_pb2.RequestInfo) -> RequestInfo:
    stamps = {field.name: value for field, value in message.timestamps.ListFields() if value}
    return RequestInfo(message.request_id, common_pb2.RequestStatus.Name(message.status), message.finish_reason,
                       message.replica_id, Usage(**{f: getattr(message.usage, f) for f in Usage.__dataclass_fields__}),
                       stamps)


def _tls(ca_file: str) -> grpc.ChannelCredentials:
    """Return channel credentials trusting the CA in `ca_file` (the API key authenticates the client)."""
    with open(ca_file, "rb") as handle:
        return grpc.ssl_channel_credentials(root_certificates=handle.read())


_STATUS_NAMES = {value.number: value.name for value in common_pb2.RequestStatus.DESCRIPTOR.values}
"""RequestStatus number -> name, looked up once per chunk (cheaper than the enum wrapper's Name())."""


def _chunk(message: admission_pb2.GenerateChunk) -> Chunk:
    # Once per streamed message: the client's own cost per token (the load generator's, in benchmarks).
    usage = Usage(**{f: getattr(message.usage, f) for f in Usage.__dataclass_fields__}) \
        if message.HasField("usage") else None
    status = message.status
    name = _STATUS_NAMES.get(status)
    return Chunk(message.request_id, message.index, tuple(message.token_ids), message.text,
                 message.finished, message.finish_reason,
                 name if name is not None else common_pb2.RequestStatus.Name(status),
                 usage, time.time(), message.created_unix_s)


def _collect(chunks: Sequence[Chunk]) -> Generation:
    last = chunks[-1] if chunks else None
    return Generation(
        request_id=last.request_id if last else "",
        text="".join(c.text for c in chunks),
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        finish_reason=last.finish_reason if last else "",
        status=last.status if last else "",
        usage=(last.usage if last and last.usage else Usage()),
    )


def build_request(prompt: str | Sequence[int], *, max_tokens: int = 16, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, priority: int = 0,
                  model: str = "", adapter_version: str = "",
                  idempotency_key: str | None = None) -> admission_pb2.GenerateRequest:
    """Return the GenerateRequest for these arguments; a fresh idempotency key unless one is given.

    Pass `idempotency_key=""` to send none (then the call is never retried).
    """
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                         max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
                                         stop_strings=list(stop), ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    request = admission_pb2.GenerateRequest(model=model, sampling=sampling, priority=priority,
                                            adapter_version=adapter_version,
                                            idempotency_key=uuid.uuid4().hex if idempotency_key is None
                                            else idempotency_key)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


class _Retrier:
    """What both clients share: metadata, deadlines and the tenacity set-up."""

    def __init__(self, api_key: str | None, retry: RetryPolicy, budget: RetryBudget | None) -> None:
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.policy = retry
        self.budget = budget or RetryBudget(ratio=retry.budget_ratio)

    @staticmethod
    def _retryable(exc: BaseException, may_retry: bool) -> bool:
        return may_retry and isinstance(exc, SluiceError) and exc.retryable

    def tenacity_kwargs(self, deadline: float | None, may_retry: bool) -> dict[str, Any]:
        """Return the keyword arguments for tenacity.Retrying / AsyncRetrying.

        tenacity asks `retry` (is the error retryable?) first and `stop` only for a retryable
        error; the budget is spent last in `stop`, so only a retry that is then made is charged
        (not one that max_attempts or the deadline forbids anyway).
        """

        def stop(state: Any) -> bool:
            if state.attempt_number >= self.policy.max_attempts:
                return True
            if deadline is not None and time.monotonic() + state.upcoming_sleep >= deadline:
                return True
            return not self.budget.try_spend()

        return dict(stop=stop, wait=full_jitter_wait(self.policy), reraise=True,
                    retry=tenacity.retry_if_exception(lambda e: self._retryable(e, may_retry)))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Return the call metadata (the API key)."""
        return self._metadata

    @staticmethod
    def remaining(deadline: float | None) -> float | None:
        """Return the seconds left until `deadline` (monotonic), or None for no deadline."""
        return None if deadline is None else max(0.001, deadline - time.monotonic())


class Client:
    """Blocking client. Thread-safe; reuse one per process. Use as a context manager or call close()."""

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None, *,
                 retry: RetryPolicy | None = None, budget: RetryBudget | None = None,
                 channel: grpc.Channel | None = None, tls_ca: str | None = None) -> None:
        """`tls_ca`: the PEM file of the CA that signed admission's certificate; the call then uses TLS."""
        self._channel = channel or (grpc.secure_channel(target, _tls(tls_ca)) if tls_ca
                                    else grpc.insecure_channel(target))
        self._stub = admission_pb2_grpc.AdmissionServiceStub(self._channel)
        self._retrier = _Retrier(api_key, retry or RetryPolicy(), budget)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **kwargs: Any) -> Iterator[Chunk]:
        """Yield the answer's chunks as they arrive (arguments: see `build_request`).

        Raises a SluiceError subclass on failure. Closing the iterator early cancels the request.
        Retries happen only before the first chunk and only with an idempotency key.
        """
        request = build_request(prompt, **kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._retrier.budget.on_call()
        call, first = self._open(request, deadline)
        try:
            if first is None:
                return
            yield _chunk(first)
            for message in call:
                yield _chunk(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    def _open(self, request: admission_pb2.GenerateRequest, deadline: float | None) -> tuple[Any, Any]:
        """Start the stream and read its first chunk, with retries; returns (call, first or None)."""
        for attempt in tenacity.Retrying(**self._retrier.tenacity_kwargs(deadline, bool(request.idempotency_key))):
            with attempt:
                call = self._stub.Generate(request, timeout=self._retrier.remaining(deadline),
                                           metadata=self._retrier.metadata())
                try:
                    return call, next(call, None)
                except grpc.RpcError as exc:
                    raise _opening_error(exc) from None
        raise AssertionError("unreachable: tenacity reraises")

    def generate_text(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                      **kwargs: Any) -> Generation:
        """Return the whole answer (text, token ids, finish reason, usage); raises like `generate`."""
        return _collect(list(self.generate(prompt, timeout=timeout, **kwargs)))

    def cancel(self, request_id: str, *, timeout: float | None = 10.0) -> str:
        """Cancel a request; returns its status name afterwards. Raises NotFound for an unknown id."""
        response = self._unary(self._stub.Cancel, admission_pb2.CancelGenerationRequest(request_id=request_id),
                               timeout)
        return common_pb2.RequestStatus.Name(response.status)

    def get_request(self, request_id: str, *, timeout: float | None = 10.0) -> RequestInfo:
        """Return what admission knows of a request (status, usage, timestamps); raises NotFound."""
        return _request_info(self._unary(self._stub.GetRequest,
                                         admission_pb2.GetRequestRequest(request_id=request_id), timeout))

    def _unary(self, method: Any, message: Any, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._retrier.budget.on_call()
        for attempt in tenacity.Retrying(**self._retrier.tenacity_kwargs(deadline, True)):
            with attempt:
                try:
                    return method(message, timeout=self._retrier.remaining(deadline),
                                  metadata=self._retrier.metadata())
                except grpc.RpcError as exc:
                    raise error_from_rpc(exc) from None
        raise AssertionError("unreachable: tenacity reraises")


class AsyncClient:
    """asyncio client; create and use it inside one event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, api_key: str | None = None, *,
                 retry: RetryPolicy | None = None, budget: RetryBudget | None = None,
                 tls_ca: str | None = None) -> None:
        """`tls_ca`: the PEM file of the CA that signed admission's certificate; the call then uses TLS."""
        self._channel = (grpc.aio.secure_channel(target, _tls(tls_ca)) if tls_ca
                         else grpc.aio.insecure_channel(target))
        self._stub = admission_pb2_grpc.AdmissionServiceStub(self._channel)
        self._retrier = _Retrier(api_key, retry or RetryPolicy(), budget)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **kwargs: Any) -> AsyncIterator[Chunk]:
        """Yield the answer's chunks as they arrive; same rules as `Client.generate`."""
        request = build_request(prompt, **kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._retrier.budget.on_call()
        call, first = await self._open(request, deadline)
        try:
            if first is grpc.aio.EOF:
                return
            yield _chunk(first)
            while (message := await call.read()) is not grpc.aio.EOF:
                yield _chunk(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    async def _open(self, request: admission_pb2.GenerateRequest, deadline: float | None) -> tuple[Any, Any]:
        kwargs = self._retrier.tenacity_kwargs(deadline, bool(request.idempotency_key))
        async for attempt in tenacity.AsyncRetrying(**kwargs):
            with attempt:
                call = self._stub.Generate(request, timeout=self._retrier.remaining(deadline),
                                           metadata=self._retrier.metadata())
                try:
                    return call, await call.read()
                except grpc.RpcError as exc:
                    raise _opening_error(exc) from None
        raise AssertionError("unreachable: tenacity reraises")

    async def generate_text(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                            **kwargs: Any) -> Generation:
        """Return the whole answer; raises like `generate`."""
        return _collect([chunk async for chunk in self.generate(prompt, timeout=timeout, **kwargs)])

    async def cancel(self, request_id: str, *, timeout: float | None = 10.0) -> str:
        """Cancel a request; returns its status name. Raises NotFound for an unknown id."""
        response = await self._unary(self._stub.Cancel,
                                     admission_pb2.CancelGenerationRequest(request_id=request_id), timeout)
        return common_pb2.RequestStatus.Name(response.status)

    async def get_request(self, request_id: str, *, timeout: float | None = 10.0) -> RequestInfo:
        """Return what admission knows of a request; raises NotFound."""
        return _request_info(await self._unary(self._stub.GetRequest,
                                               admission_pb2.GetRequestRequest(request_id=request_id), timeout))

    async def _unary(self, method: Any, message: Any, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._retrier.budget.on_call()
        async for attempt in tenacity.AsyncRetrying(**self._retrier.tenacity_kwargs(deadline, True)):
            with attempt:
                try:
                    return await method(message, timeout=self._retrier.remaining(deadline),
                                        metadata=self._retrier.metadata())
                except grpc.RpcError as exc:
                    raise error_from_rpc(exc) from None
        raise AssertionError("unreachable: tenacity reraises")
