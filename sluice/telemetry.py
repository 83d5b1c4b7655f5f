"""Tracing set-up and W3C trace-context propagation across gRPC metadata and Redis stream entries.

One trace per request: admission starts the root span; every hop carries `traceparent`/`tracestate`
(gRPC metadata on calls, entry fields on Redis streams) and the next service continues it.

Exporters, chosen by environment:
- `OTEL_EXPORTER_OTLP_ENDPOINT` set: OTLP over gRPC (needs `opentelemetry-exporter-otlp-proto-grpc`).
- `SLUICE_TRACE_FILE` set: one JSON object per finished span, appended to that file. Tests that run
  several processes point them all at one file and read the spans back with `read_span_file`.
- Tests in one process add an `InMemorySpanExporter` to the provider `setup_tracing` returns.

The OpenTelemetry global tracer provider can be set only once per process, so `setup_tracing` is
idempotent: a second call (another service hosted in the same test process) returns the same provider.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "ERROR_STATUSES", "GEN_AI_OPERATION_NAME", "GEN_AI_REQUEST_MODEL", "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_ID", "GEN_AI_RESPONSE_MODEL", "GEN_AI_USAGE_INPUT_TOKENS", "GEN_AI_USAGE_OUTPUT_TOKENS",
    "TRACE_FIELDS", "JsonLinesSpanExporter", "end_request_span", "extract_fields", "extract_metadata",
    "get_tracer", "inject_fields", "inject_metadata", "link_to", "read_span_file", "setup_tracing",
]

# OpenTelemetry GenAI semantic conventions (attribute names only; values set by the services).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"

# The W3C trace-context carrier keys, on gRPC metadata and on Redis entries alike.
TRACE_FIELDS = ("traceparent", "tracestate")

ERROR_STATUSES = frozenset({"FAILED", "TIMED_OUT", "REJECTED"})
"""Terminal request statuses (RequestStatus names) that make a span's status ERROR: the server failed, ran
out of time or could not place the request. A cancel (the client's, or a drain's) is an outcome, not an error."""

_PROPAGATOR = TraceContextTextMapPropagator()
_setup_lock = threading.Lock()
_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line to a file shared by several processes.

    Each line is written with a single `write` on a file opened with O_APPEND, so lines of
    different processes do not interleave.
    """

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the spans; return SUCCESS, or FAILURE when the file cannot be written."""
        lines = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans)
        try:
            with self._lock:
                for line in lines.splitlines(keepends=True):
                    os.write(self._fd, line.encode())
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the file."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """Return a JSON-ready dict of a finished span: ids in hex, times in Unix nanoseconds, events, links."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": format(ctx.trace_id, "032x") if ctx else "",
        "span_id": format(ctx.span_id, "016x") if ctx else "",
        "parent_span_id": format(parent.span_id, "016x") if parent else "",
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": format(link.context.trace_id, "032x"), "span_id": format(link.context.span_id, "016x"),
                   "attributes": dict(link.attributes or {})} for link in span.links],
    }


def read_span_file(path: str | Path) -> list[dict[str, Any]]:
    """Return the spans written by JsonLinesSpanExporter to `path`, in file order ([] if the file is absent)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _otlp_processor(endpoint: str) -> BatchSpanProcessor:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise RuntimeError(
            f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r} is set but the package "
            "opentelemetry-exporter-otlp-proto-grpc is not installed; install it or unset the variable"
        ) from exc
    return BatchSpanProcessor(OTLPSpanExporter())


def setup_tracing(service_name: str) -> TracerProvider:
    """Install (once per process) and return the SDK tracer provider with the exporters the environment asks for.

    Raises RuntimeError when OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter is not installed.
    """
    global _provider
    with _setup_lock:
        if _provider is not None:
            return _provider
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if endpoint:
            provider.add_span_processor(_otlp_processor(endpoint))
        trace_file = os.environ.get("SLUICE_TRACE_FILE", "")
        if trace_file:
            # Simple (synchronous) so that spans are on disk even if the process is killed later.
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def end_request_span(span: trace.Span, status_name: str, detail: str = "", end_time: int | None = None) -> None:
    """Record a request's terminal status on `span` and end it, the same way in every service.

    `status_name` is the RequestStatus name (`FINISHED_STOP`, `CANCELLED`, ...), the one spelling of a status
    across services: attribute `sluice.status`; the span status is ERROR (with `error.type`) only for
    ERROR_STATUSES.
    """
    span.set_attribute("sluice.status", status_name)
    if status_name in ERROR_STATUSES:
        span.set_attribute("error.type", status_name)
        span.set_status(trace.Status(trace.StatusCode.ERROR, detail or status_name))
    span.end(end_time=end_time)


def link_to(traceparent: str, tracestate: str = "", **attributes: str) -> trace.Link | None:
    """Return a span link to the span a W3C `traceparent` names (None when it is malformed)."""
    carrier = {"traceparent": traceparent, "tracestate": tracestate} if tracestate else {"traceparent": traceparent}
    context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    if not context.is_valid:
        return None
    return trace.Link(context, attributes=attributes)


def get_tracer(name: str) -> trace.Tracer:
    """Return a tracer from the global provider (a no-op tracer until setup_tracing has run)."""
    return trace.get_tracer(name)


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """Return gRPC metadata carrying the trace context of `context` (default: the current one); [] if none."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def extract_metadata(metadata: Iterable[Any] | None) -> Context:
    """Return the Context carried by gRPC invocation metadata (tuples or grpc metadatum objects).

    Without a valid `traceparent` the result is an empty Context (a new span then starts a new trace).
    """
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if isinstance(value, bytes):
            continue  # binary metadata (-bin keys) never carries trace context
        carrier[str(key).lower()] = value
    return _PROPAGATOR.extract(carrier)


def inject_fields(context: Context | None = None) -> dict[str, str]:
    """Return Redis entry fields carrying the trace context of `context` (default: the current one); {} if none."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract_fields(fields: Mapping[Any, Any]) -> Context:
    """Return the Context carried by a Redis entry's fields (keys and values as bytes or str)."""
    carrier: dict[str, str] = {}
    for key, value in fields.items():
        k = key.decode() if isinstance(key, bytes) else str(key)
        if k in TRACE_FIELDS:
            carrier[k] = value.decode() if isinstance(value, bytes) else str(value)
    return _PROPAGATOR.extract(carrier)


def current_context() -> Context:
    """Return the active OpenTelemetry context (for handing to code that runs later)."""
    return otel_context.get_current()
