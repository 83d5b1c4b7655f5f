"""Conversions of the admission service: wire messages <-> what the core and the streams use.

Also the model admission serves (tokenizer, length, end-of-sequence token) and the incremental
detokenizer, because both turn token ids into what the client sees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from admission_svc.calls import GenerateCall, Output
from sluice import convert as shared_convert
from sluice import errors
from sluice.tokenizer import REPLACEMENT_CHAR, TextTokenizer
from sluice.v1 import admission_pb2, common_pb2, events_pb2, scheduler_pb2

TERMINAL = frozenset({common_pb2.FINISHED_STOP, common_pb2.FINISHED_LENGTH, common_pb2.CANCELLED,
                      common_pb2.TIMED_OUT, common_pb2.FAILED, common_pb2.REJECTED})


@dataclass(frozen=True)
class ModelSpec:
    """The model this admission process tokenizes for."""

    model_id: str
    """The id replicas register under (router matches on it)."""
    aliases: frozenset[str]
    """Other names a client may use ("" and the preset name, e.g. "tiny")."""
    max_model_len: int
    eos_token_id: int
    vocab_size: int
    tokenizer: TextTokenizer = field(repr=False)

    def accepts(self, name: str) -> bool:
        """Return True when a request naming `name` is for this model."""
        return name == self.model_id or name in self.aliases


def load_model_spec(model_dir: Path, model_id: str, aliases: Sequence[str] = ()) -> ModelSpec:
    """Return the ModelSpec of a Hugging Face-style directory (config.json + tokenizer.json).

    Raises FileNotFoundError or ValueError for a missing or malformed directory.
    """
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = TextTokenizer.from_file(model_dir / "tokenizer.json")
    eos = config.get("eos_token_id", tokenizer.token_id("</s>"))
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise ValueError(f"{model_dir}/config.json names no eos_token_id")
    max_len = int(config.get("max_position_embeddings", config.get("max_model_len", 2048)))
    return ModelSpec(model_id, frozenset({"", *aliases}), max_len, int(eos),
                     int(config.get("vocab_size", tokenizer.vocab_size)), tokenizer)


class Detokenizer:
    """Turns a growing list of token ids into text increments, holding back split UTF-8 characters.

    Decodes only a short window (from the last emitted boundary), not the whole output each time,
    so a long answer costs linear, not quadratic, decoding work.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        """Start of the window: tokens before it are emitted and never decoded again."""
        self._read_offset = 0
        """Tokens before this are emitted; [prefix_offset, read_offset) gives decoding context."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (may be "" while a character is incomplete)."""
        self._ids.extend(t for t in token_ids if t >= 0)
        window = self._ids[self._prefix_offset:]
        seen = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._tokenizer.decode(window)
        if len(text) <= len(seen) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(seen):]

    def flush(self) -> str:
        """Return the text still held back at the end (an incomplete character shows as U+FFFD)."""
        seen = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(seen):] if text.startswith(seen) else text


def generate_call(request: admission_pb2.GenerateRequest) -> GenerateCall:
    """Return the front door's GenerateCall for a Generate message (unset sampling values resolved)."""
    return GenerateCall(prompt=request.prompt, prompt_token_ids=tuple(request.prompt_token_ids), model=request.model,
                        sampling=shared_convert.sampling_from_proto(request.sampling), priority=request.priority,
                        adapter_version=request.adapter_version, idempotency_key=request.idempotency_key)


def submit_request(request_id: str, tenant: str, prompt_ids: Sequence[int], call: GenerateCall,
                   owner: str, deadline_unix_s: float, eos_token_id: int,
                   timestamps: common_pb2.LifecycleTimestamps, tenant_weight: float) -> scheduler_pb2.SubmitRequest:
    """Return the scheduler's SubmitRequest for an admitted request."""
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, tenant=tenant, prompt_token_ids=list(prompt_ids),
        sampling=shared_convert.sampling_to_proto(call.sampling), priority=call.priority,
        deadline_unix_s=deadline_unix_s, owner=owner, timestamps=timestamps, eos_token_id=eos_token_id,
        tenant_weight=tenant_weight)


def chunk_of(output: Output) -> admission_pb2.GenerateChunk:
    """Return the GenerateChunk of a front-door Output (new tokens, or the last chunk of a finished request)."""
    if output.completion is None:
        return chunk(output.request_id, output.index, output.token_ids, output.text, output.created_unix_s)
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
