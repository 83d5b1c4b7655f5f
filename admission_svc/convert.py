"""Conversions of the admission service: wire messages <-> what the core and the streams use.

The model admission serves (sluice.model_spec.ModelSpec) and the incremental detokenizer
(sluice.tokenizer.Detokenizer) live on the ground floor, shared with the worker's loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from admission_svc.calls import GenerateCall, Output
from admission_svc.ranges import check_wire_top_p
from sluice import convert as shared_convert
from sluice import errors
from sluice.model_spec import ModelSpec
from sluice.v1 import admission_pb2, common_pb2, events_pb2, scheduler_pb2


def generate_call(request: admission_pb2.GenerateRequest) -> GenerateCall:
    """Return the front door's GenerateCall for a Generate message (unset sampling values resolved).

    Raises InvalidRequest for a top_p that is neither unset (0) nor in (0, 1]: the shared conversion reads
    every top_p <= 0 as unset, so a -0.5 or a NaN would otherwise pass as 1.0."""
    check_wire_top_p(request.sampling.top_p)
    return GenerateCall(prompt=request.prompt, prompt_token_ids=tuple(request.prompt_token_ids), model=request.model,
                        sampling=shared_convert.sampling_from_proto(request.sampling), priority=request.priority,
                        adapter_version=request.adapter_version, idempotency_key=request.idempotency_key)


def submit_request(request_id: str, tenant: str, prompt_ids: Sequence[int], call: GenerateCall,
                   owner: str, deadline_unix_s: float, model: ModelSpec,
                   timestamps: common_pb2.LifecycleTimestamps, tenant_weight: float,
                   cache_salt: str = "", stream_interval: int = 1) -> scheduler_pb2.SubmitRequest:
    """Return the scheduler's SubmitRequest for an admitted request.

    The model's first EOS id travels as eos_token_id, the others as stop token ids (unless the
    request ignores EOS), so that every one of them ends generation. `stream_interval`: admission's own
    (--stream-interval); the larger of it and the call's travels, 1 as unset.
    """
    interval = max(call.stream_interval, stream_interval)
    sampling = dataclasses.replace(call.sampling, stop_token_ids=model.stop_token_ids(
        call.sampling.stop_token_ids, call.sampling.ignore_eos))
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, tenant=tenant, prompt_token_ids=list(prompt_ids),
        sampling=shared_convert.sampling_to_proto(sampling), priority=call.priority,
        deadline_unix_s=deadline_unix_s, owner=owner, timestamps=timestamps, eos_token_id=model.eos_token_id,
        tenant_weight=tenant_weight, cache_salt=cache_salt, stream_interval=interval if interval > 1 else 0)


def chunk_of(output: Output) -> admission_pb2.GenerateChunk:
    """Return the GenerateChunk of a front-door Output (new tokens, or the last chunk of a finished request)."""
    if output.completion is None:
        message = chunk(output.request_id, output.index, output.token_ids, output.text, output.created_unix_s)
        message.logprobs.extend(output.logprobs)
        return message
    return final_chunk(output.request_id, output.index, output.completion, output.text)


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
