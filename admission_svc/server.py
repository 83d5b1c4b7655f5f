"""The admission service over gRPC: AdmissionService (Generate, Cancel, GetRequest) around the FrontDoor.

Each RPC converts its message, calls the front door (admission_svc/frontdoor.py) and converts back;
refusals and requests that end without finishing are raised and mapped to statuses by the one
ErrorInterceptor. `build_server` also bounds what a client may send: the interceptor refuses a
message over `max_message_bytes` (and one that does not parse) with INVALID_ARGUMENT, and gRPC
itself drops anything over `HARD_LIMIT_FACTOR` times that before reading it into memory.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from admission_svc import convert
from admission_svc.calls import Caller
from admission_svc.frontdoor import FrontDoor
from sluice import services, telemetry
from sluice.errors import ErrorInterceptor
from sluice.serve import grpc_server
from sluice.v1 import admission_pb2, admission_pb2_grpc

DEFAULT_MAX_MESSAGE_BYTES = 2 << 20
"""Largest request message admission parses: a prompt at the default max_prompt_bytes (1 MiB) plus
room for every other field."""
HARD_LIMIT_FACTOR = 4
"""gRPC's own receive limit, as a multiple of max_message_bytes: above it gRPC answers
RESOURCE_EXHAUSTED itself (nothing can change its status); between the two we answer INVALID_ARGUMENT."""
UNREQUESTED_CALL_LIMIT_S = 3600
"""How long gRPC core keeps a call that arrived but that the server's event loop has not picked up yet
(`grpc.server_max_unrequested_time_in_server`). Core's default is 30 s, after which it cancels the call itself:
the client gets a bare CANCELLED (no status details, no RetryInfo) and admission never hears of it. Under
overload admission's event loop picks calls up slower than they arrive (one per loop iteration), so calls did
wait that long: 0 to ~5,500 requests a 60 s run at 3x overload ended so. With an hour, every call reaches
the handlers and gets an explicit answer (served, or refused RESOURCE_EXHAUSTED with RetryInfo); a call that
waited past its own deadline ends DEADLINE_EXCEEDED at the client, which is what its deadline asked for."""

PENDING_CALL_LIMIT = 65536
"""How many calls may wait in gRPC core for admission's event loop to pick them up (`grpc.server.max_pending_requests`
and `..._hard_limit`, both). Core's defaults are 1,000 and 3,000: above 1,000 waiting calls it drops a growing share
of new ones at random, and every one above 3,000, by destroying the call before the application sees it, so the
client gets a bare CANCELLED (details `CANCELLED`, no status details, no RetryInfo). Under 3x overload the backlog
passes 1,000 whenever admission's loop falls behind (docs/operations.md, "Overload"). With soft = hard there is no
random early drop: every call reaches the handlers, which refuse what they cannot serve explicitly (RESOURCE_EXHAUSTED
with RetryInfo). The bound stays, so a flood cannot queue without limit in core."""


def api_key_of(metadata: Any) -> str | None:
    """Return the bearer key of a call's metadata (`authorization: Bearer <key>`, or a bare key), or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else value.strip()
    return None


def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    """Return what the front door needs to know about a gRPC call: key, deadline, trace context."""
    metadata = context.invocation_metadata()
    remaining = context.time_remaining()
    return Caller(api_key=api_key_of(metadata),
                  deadline_unix_s=time.time() + remaining if remaining is not None else None,
                  trace_context=telemetry.extract_metadata(metadata))


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """The front door over gRPC: convert, call the FrontDoor, convert back."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door

    async def Generate(self, request: admission_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[admission_pb2.GenerateChunk]:
        """Stream a generation; every refusal is raised by the front door before the first chunk."""
        record = await self.door.start(convert.generate_call(request), caller_of(context))
        async for output in self.door.stream(record):
            yield convert.chunk_of(output)

    async def Cancel(self, request: admission_pb2.CancelGenerationRequest,
                     context: grpc.aio.ServicerContext) -> admission_pb2.CancelGenerationResponse:
        """Cancel one of the caller's requests; returns its status (terminal ones are left as they are)."""
        status = await self.door.cancel(request.request_id, api_key_of(context.invocation_metadata()))
        return admission_pb2.CancelGenerationResponse(status=status)

    async def GetRequest(self, request: admission_pb2.GetRequestRequest,
                         context: grpc.aio.ServicerContext) -> admission_pb2.RequestInfo:
        """Return one of the caller's requests (status, usage, timestamps, replica)."""
        record = self.door.lookup(request.request_id, api_key_of(context.invocation_metadata()))
        return convert.request_info(record.request_id, record.status, record.completion, record.replica_id,
                                    record.timestamps)


def build_server(door: FrontDoor, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Server:
    """Return a gRPC server (not started, no port) serving `door` behind the ErrorInterceptor and the size limits."""
    options = [("grpc.max_receive_message_length", HARD_LIMIT_FACTOR * max_message_bytes),
               ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_LIMIT_S),
               ("grpc.server.max_pending_requests", PENDING_CALL_LIMIT),
               ("grpc.server.max_pending_requests_hard_limit", PENDING_CALL_LIMIT),
               *extra_options]
    server = grpc_server(services.ADMISSION, interceptors=[ErrorInterceptor(max_message_bytes=max_message_bytes)],
                         options=options)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmissionServicer(door), server)
    return server
