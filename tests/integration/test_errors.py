"""Domain errors reach clients as precise gRPC statuses with details, through a real server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from admission_svc.core import InvalidRequest, OverBudget
from router_svc.core import IllegalReplicaTransition, NoReplicaAvailable, ReplicaInput, ReplicaState
from sluice.core_errors import RequestRejected
from sluice.errors import ErrorInterceptor, NotFound, details_of
from sluice.types import RejectReason
from sluice.v1 import admission_pb2, admission_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class Failing(scheduler_pb2_grpc.SchedulerServiceServicer, admission_pb2_grpc.AdmissionServiceServicer):
    """Each RPC raises the core exception named by the request id."""

    errors = {
        "budget": OverBudget("tenant.active", 2.5, "tenant budget active is full"),
        "invalid": InvalidRequest("sampling.max_tokens", "prompt (10 tokens) + max_tokens (9000) exceeds 4096"),
        "replica": NoReplicaAvailable("no READY replica"),
        "never": RequestRejected("never", RejectReason.NEVER_FITS, "needs 300 blocks, replica has 256"),
        "illegal": IllegalReplicaTransition("r1", ReplicaState.DRAINING, ReplicaInput.WARMED),
        "bug": ZeroDivisionError("not a domain error"),
    }

    async def Cancel(self, request, context):  # noqa: N802 - gRPC method name
        raise self.errors[request.request_id]

    async def Generate(self, request, context):  # noqa: N802
        yield admission_pb2.GenerateChunk(request_id="first")
        raise self.errors[request.model]


async def _call_all() -> dict[str, grpc.aio.AioRpcError]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(Failing(), server)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(Failing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, grpc.aio.AioRpcError] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            for name in Failing.errors:
                try:
                    await stub.Cancel(scheduler_pb2.CancelRequest(request_id=name))
                except grpc.aio.AioRpcError as exc:
                    out[name] = exc
            stream = admission_pb2_grpc.AdmissionServiceStub(channel).Generate(
                admission_pb2.GenerateRequest(model="budget"))
            try:
                async for chunk in stream:
                    assert chunk.request_id == "first"
            except grpc.aio.AioRpcError as exc:
                out["stream"] = exc
    finally:
        await server.stop(None)
    return out


def test_core_errors_become_statuses_with_details() -> None:
    """OverBudget -> RESOURCE_EXHAUSTED + RetryInfo; InvalidRequest -> INVALID_ARGUMENT + field;
    NoReplicaAvailable -> UNAVAILABLE; an illegal replica transition -> FAILED_PRECONDITION; NEVER_FITS -> INVALID_ARGUMENT; other exceptions stay UNKNOWN."""
    out = asyncio.run(_call_all())
    budget = details_of(out["budget"])
    assert budget.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert budget.retry_after_s == pytest.approx(2.5)
    assert budget.metadata == {"budget": "tenant.active"}
    invalid = details_of(out["invalid"])
    assert (invalid.code, invalid.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens")
    assert "9000" in invalid.message
    assert details_of(out["replica"]).code is grpc.StatusCode.UNAVAILABLE
    never = details_of(out["never"])
    assert (never.code, never.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "never_fits")
    illegal = details_of(out["illegal"])
    assert (illegal.code, illegal.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "illegal_replica_transition")
    assert out["bug"].code() is grpc.StatusCode.UNKNOWN
    stream = details_of(out["stream"])
    assert stream.code is grpc.StatusCode.RESOURCE_EXHAUSTED and stream.retry_after_s == pytest.approx(2.5)


class EchoesHugeValues(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Cancel refuses with a message, field and metadata that echo the (huge) request id whole."""

    async def Cancel(self, request, context):  # noqa: N802 - gRPC method name
        raise NotFound(f"request {request.request_id!r} is not known", field_name=request.request_id,
                       metadata={"request_id": request.request_id})


def test_errors_echoing_huge_values_still_reach_the_client() -> None:
    """A 64 KiB value echoed in an error is clipped on the wire: the client gets NOT_FOUND with a short message
    saying how long the text was, not RESOURCE_EXHAUSTED from trailers over gRPC's metadata limit."""
    async def body() -> grpc.aio.AioRpcError:
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(EchoesHugeValues(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await scheduler_pb2_grpc.SchedulerServiceStub(channel).Cancel(
                        scheduler_pb2.CancelRequest(request_id="é" * 65536))
                return err.value
        finally:
            await server.stop(None)

    details = details_of(asyncio.run(body()))
    assert details.code is grpc.StatusCode.NOT_FOUND
    assert len(details.message) < 300 and details.message.endswith("characters)")
    assert len(details.metadata["request_id"]) < 200 and len(details.field_name) < 200
