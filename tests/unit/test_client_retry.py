"""The client SDK against a real gRPC server on loopback that plays scripted answers.

The server is a stand-in for admission (the component under test is the SDK): it fails the
first calls with chosen statuses and details, then streams chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from sluice._retry import RetryBudget, RetryPolicy
from sluice.client import (
    DROPPED_RETRY_S,
    AsyncClient,
    Cancelled,
    Client,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2


def _status(code: int, message: str, retry_delay_s: float | None = None) -> grpc.Status:
    details = []
    if retry_delay_s is not None:
        packed = any_pb2.Any()
        packed.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=int(retry_delay_s), nanos=int((retry_delay_s % 1) * 1e9))))
        details.append(packed)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=details))


class ScriptedAdmission(admission_pb2_grpc.AdmissionServiceServicer):
    """Fails the first `failures` Generate calls with `failure`, then streams two chunks."""

    def __init__(self, failures: int = 0, failure: grpc.Status | None = None) -> None:
        self.failures = failures
        self.failure = failure
        self.calls: list[tuple[float, str, str]] = []

    def Generate(self, request: admission_pb2.GenerateRequest, context: grpc.ServicerContext) -> Iterator:
        key = dict(context.invocation_metadata()).get("authorization", "")
        self.calls.append((time.monotonic(), request.idempotency_key, key))
        if len(self.calls) <= self.failures:
            context.abort_with_status(self.failure)
        yield admission_pb2.GenerateChunk(request_id="r1", index=0, token_ids=[5, 6], text="he")
        yield admission_pb2.GenerateChunk(request_id="r1", index=2, token_ids=[7], text="y", finished=True,
                                          finish_reason="length", status=common_pb2.FINISHED_LENGTH,
                                          usage=common_pb2.Usage(input_tokens=3, output_tokens=3))


@pytest.fixture
def serve():
    servers = []

    def start(servicer: ScriptedAdmission) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def test_generate_text_joins_chunks_and_sends_key(serve) -> None:
    """generate_text returns the concatenated text, token ids, finish reason and usage, and sends the API key."""
    servicer = ScriptedAdmission()
    with Client(serve(servicer), api_key="sk-a") as client:
        result = client.generate_text("hi", max_tokens=3)
    assert (result.text, result.token_ids, result.finish_reason) == ("hey", (5, 6, 7), "length")
    assert result.usage.output_tokens == 3 and result.status == "FINISHED_LENGTH"
    assert servicer.calls[0][2] == "Bearer sk-a"


def test_retry_honours_retry_info_and_keeps_idempotency_key(serve) -> None:
    """An overload answer with RetryInfo is retried no sooner than the server's delay, with the same key."""
    servicer = ScriptedAdmission(1, _status(code_pb2.RESOURCE_EXHAUSTED, "over budget", 0.3))
    with Client(serve(servicer), retry=RetryPolicy(initial_backoff_s=0.001)) as client:
        assert client.generate_text("hi").text == "hey"
    (first_at, first_key, _), (second_at, second_key, _) = servicer.calls
    assert second_at - first_at >= 0.3
    assert first_key and first_key == second_key


def test_no_retry_without_idempotency_key(serve) -> None:
    """A Generate sent without an idempotency key is never retried, and the error is typed with its delay."""
    servicer = ScriptedAdmission(1, _status(code_pb2.RESOURCE_EXHAUSTED, "over budget", 0.01))
    with Client(serve(servicer)) as client, pytest.raises(ResourceExhausted) as info:
        client.generate_text("hi", idempotency_key="")
    assert len(servicer.calls) == 1 and info.value.retry_delay_s == pytest.approx(0.01)


def test_invalid_argument_is_not_retried(serve) -> None:
    """A caller error (INVALID_ARGUMENT) is raised at once as InvalidArgument with the server's message."""
    servicer = ScriptedAdmission(5, _status(code_pb2.INVALID_ARGUMENT, "max_tokens must be >= 1, got 0"))
    with Client(serve(servicer)) as client, pytest.raises(InvalidArgument, match="got 0"):
        client.generate_text("hi")
    assert len(servicer.calls) == 1


def test_retry_budget_stops_a_retry_storm(serve) -> None:
    """Under persistent overload, retries stay within the token bucket: at most reserve + 10% of calls."""
    servicer = ScriptedAdmission(10_000, _status(code_pb2.UNAVAILABLE, "no ready replica"))
    budget = RetryBudget(ratio=0.1, reserve=2.0)
    with Client(serve(servicer), retry=RetryPolicy(initial_backoff_s=0.0001, max_backoff_s=0.0001),
                budget=budget) as client:
        for _ in range(30):
            with pytest.raises(Unavailable):
                client.generate_text("hi")
    retries = len(servicer.calls) - 30
    assert 0 < retries <= 2 + 0.1 * 30 + 1


def test_budget_is_not_charged_for_retries_that_are_not_made(serve) -> None:
    """With max_attempts=1, failed calls only deposit: the budget grows instead of draining (3.0 -> 3.4)."""
    servicer = ScriptedAdmission(10_000, _status(code_pb2.UNAVAILABLE, "no ready replica"))
    budget = RetryBudget(ratio=0.1, reserve=3.0)
    with Client(serve(servicer), retry=RetryPolicy(max_attempts=1), budget=budget) as client:
        for _ in range(4):
            with pytest.raises(Unavailable):
                client.generate_text("hi")
    assert len(servicer.calls) == 4
    assert budget.balance == pytest.approx(3.4)


def test_budget_is_charged_once_per_retry_made(serve) -> None:
    """With max_attempts=2 each failing call makes one retry and pays exactly one token for it."""
    servicer = ScriptedAdmission(10_000, _status(code_pb2.UNAVAILABLE, "no ready replica"))
    budget = RetryBudget(ratio=0.1, reserve=3.0)
    with Client(serve(servicer), retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.0001, max_backoff_s=0.0001),
                budget=budget) as client:
        for _ in range(2):
            with pytest.raises(Unavailable):
                client.generate_text("hi")
    assert len(servicer.calls) == 4
    assert budget.balance == pytest.approx(3.0 + 0.2 - 2.0)


def test_async_budget_is_not_charged_when_the_deadline_forbids_the_retry(serve) -> None:
    """AsyncClient: a retry the deadline rules out (RetryInfo longer than the timeout) costs nothing."""
    servicer = ScriptedAdmission(10_000, _status(code_pb2.RESOURCE_EXHAUSTED, "over budget", 5.0))
    budget = RetryBudget(ratio=0.1, reserve=3.0)

    async def main() -> None:
        async with AsyncClient(serve(servicer), budget=budget) as client:
            for _ in range(3):
                with pytest.raises(ResourceExhausted):
                    await client.generate_text("hi", timeout=1.0)

    asyncio.run(main())
    assert len(servicer.calls) == 3
    assert budget.balance == pytest.approx(3.3)


def test_async_client_streams_and_types_errors(serve) -> None:
    """AsyncClient streams the same chunks and raises Unauthenticated for a rejected key."""
    ok = serve(ScriptedAdmission())
    bad = serve(ScriptedAdmission(1, _status(code_pb2.UNAUTHENTICATED, "unknown API key")))

    async def main() -> tuple[list[str], str]:
        async with AsyncClient(ok) as client:
            texts = [chunk.text async for chunk in client.generate("hi")]
        async with AsyncClient(bad, api_key="nope") as client:
            try:
                await client.generate_text("hi")
            except Unauthenticated as exc:
                return texts, exc.message
        return texts, ""

    texts, message = asyncio.run(main())
    assert texts == ["he", "y"] and message == "unknown API key"


def test_a_bare_cancelled_before_any_chunk_is_unavailable_with_a_retry_delay(serve) -> None:
    """A CANCELLED without the server's status details before the first chunk (gRPC's transport dropping a call
    admission never answered, seen under 3x overload) is raised as Unavailable with the SDK's retry delay, and is
    retried like any overload answer when the request has an idempotency key."""
    bare = grpc.Status()
    bare.code, bare.details, bare.trailing_metadata = grpc.StatusCode.CANCELLED, "CANCELLED", ()
    with Client(serve(ScriptedAdmission(1, bare)), retry=RetryPolicy(max_attempts=1)) as client, \
            pytest.raises(Unavailable) as raised:
        client.generate_text("hi")
    assert raised.value.retryable and raised.value.retry_delay_s == DROPPED_RETRY_S
    assert "before admission answered it" in raised.value.message
    servicer = ScriptedAdmission(1, bare)
    with Client(serve(servicer), retry=RetryPolicy(initial_backoff_s=0.001)) as client:
        assert client.generate_text("hi", idempotency_key="k-1").text == "hey"
    assert len(servicer.calls) == 2


def test_a_cancelled_request_stays_cancelled(serve) -> None:
    """Admission's own CANCELLED (it carries status details) is still raised as Cancelled, not retried."""
    servicer = ScriptedAdmission(1, _status(code_pb2.CANCELLED, "request r1 CANCELLED after 0 output tokens"))
    with Client(serve(servicer), retry=RetryPolicy(initial_backoff_s=0.001)) as client, pytest.raises(Cancelled):
        client.generate_text("hi", idempotency_key="k-2")
    assert len(servicer.calls) == 1
