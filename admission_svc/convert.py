"""Conversions of the admission service: wire messages <-> what the core and the streams use.

The model admission serves (sluice.model_spec.ModelSpec) and the incremental detokenizer
(sluice.tokenizer.Detokenizer) live on the ground floor, shared with the worker's loader.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from sluice import convert as shared_convert
from sluice import errors
from sluice.model_spec import ModelSpec
from sluice.v1 import admission_pb2, common_pb2, events_pb2, scheduler_pb2

# Terminal statuses that end a stream with a non-OK gRPC status (the client SDK raises them typed).
FAILURE_STATUS: dict[int, grpc.StatusCode] = {
    common_pb2.CANCELLED: grpc.StatusCode.CANCELLED,
    common_pb2.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    common_pb2.FAILED: grpc.StatusCode.INTERNAL,
    common_pb2.REJECTED: grpc.StatusCode.UNAVAILABLE,  # could not be placed: a later retry may be
}
TERMINAL = frozenset({common_pb2.FINISHED_STOP, common_pb2.FINISHED_LENGTH, common_pb2.CANCELLED,
                      common_pb2.TIMED_OUT, common_pb2.FAILED, common_pb2.REJECTED})


def submit_request(request_id: str, tenant: str, prompt_ids: Sequence[int], request: admission_pb2.GenerateRequest,
                   owner: str, deadline_unix_s: float, model: ModelSpec,
                   timestamps: common_pb2.LifecycleTimestamps, tenant_weight: float) -> scheduler_pb2.SubmitRequest:
    """Return the scheduler's SubmitRequest for an admitted request.

    The model's first EOS id travels as eos_token_id, the others as stop token ids (unless the
    request ignores EOS), so that every one of them ends generation.
    """
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    sampling.top_p = shared_convert.wire_top_p(sampling.top_p)
    sampling.stop_token_ids[:] = model.stop_token_ids(sampling.stop_token_ids, sampling.ignore_eos)
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, tenant=tenant, prompt_token_ids=list(prompt_ids), sampling=sampling,
        priority=request.priority, deadline_unix_s=deadline_unix_s, owner=owner,
        timestamps=timestamps, eos_token_id=model.eos_token_id, tenant_weight=tenant_weight)


def chunk(request_id: str, index: int, token_ids: Sequence[int], text: str,
          created_unix_s: float) -> admission_pb2.GenerateChunk:
    """Return a GenerateChunk carrying new tokens."""
    return admission_pb2.GenerateChunk(request_id=request_id, index=index, token_ids=list(token_ids), text=text,
                                       status=common_pb2.RUNNING, created_unix_s=created_unix_s)


def final_chunk(request_id: str, index: int, completion: events_pb2.Completion,
                text: str = "") -> admission_pb2.GenerateChunk:
    """Return the last GenerateChunk of a successful request (held-back text, finish reason, status, usage)."""
    return admission_pb2.GenerateChunk(request_id=request_id, index=index, finished=True, text=text,
                                       finish_reason=completion.finish_reason, status=completion.status,
                                       usage=completion.usage)


def failure_of(completion: events_pb2.Completion) -> tuple[grpc.StatusCode, str] | None:
    """Return (gRPC code, message) when a completion ends the stream with an error, else None."""
    if completion.status not in FAILURE_STATUS:
        return None
    code = FAILURE_STATUS[completion.status]
    status = common_pb2.RequestStatus.Name(completion.status)
    detail = f": {completion.detail}" if completion.detail else ""
    return code, (f"request {completion.request_id} {status} after {completion.usage.output_tokens} "
                  f"output tokens{detail}")


def error_from_downstream(exc: grpc.aio.AioRpcError, what: str) -> errors.SluiceError:
    """Return a SluiceError that passes a router or scheduler failure on with its code and retry delay."""
    got = errors.details_of(exc)
    by_code: dict[grpc.StatusCode, type[errors.SluiceError]] = {
        grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument, grpc.StatusCode.NOT_FOUND: errors.NotFound,
        grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
        grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
        grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    }
    kind = by_code.get(got.code, errors.Unavailable)
    retry = got.retry_after_s
    if kind is errors.Unavailable and retry is None:
        retry = 1.0
    return kind(f"{what}: {got.message or got.code.name}", reason=got.reason or "downstream_error",
                field_name=got.field_name, metadata=got.metadata, retry_after_s=retry)


def request_info(request_id: str, status: common_pb2.RequestStatus, completion: events_pb2.Completion | None,
                 replica_id: str, timestamps: common_pb2.LifecycleTimestamps) -> admission_pb2.RequestInfo:
    """Return the RequestInfo of a request (the completion's view when it has one)."""
    info = admission_pb2.RequestInfo(request_id=request_id, status=status, replica_id=replica_id)
    info.timestamps.CopyFrom(timestamps)
    if completion is not None:
        info.status = completion.status
        info.finish_reason = completion.finish_reason
        info.usage.CopyFrom(completion.usage)
        merged = info.timestamps
        for name in ("first_scheduled", "first_token", "finished", "kv_released", "enqueued"):
            value = getattr(completion.timestamps, name)
            if value:
                setattr(merged, name, value)
    return info
