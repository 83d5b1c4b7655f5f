"""Tracing set-up and W3C trace-context propagation across gRPC metadata and Redis stream entries.

One trace per request: admission starts the root span; every hop carries `traceparent`/`tracestate`
(gRPC metadata on calls, entry fields on Redis streams) and the next service continues it.

Exporters, chosen by the OpenTelemetry standard environment variables (`trace_exporters`):
- `OTEL_TRACES_EXPORTER`: a comma-separated list of `otlp` (OTLP over gRPC to `OTEL_EXPORTER_OTLP_ENDPOINT`,
  default http://localhost:4317; the exporter is in the server extra), `console` (one JSON line per finished
  span on stderr, i.e. in each service's log) and `none`. Unset: `otlp` when `OTEL_EXPORTER_OTLP_ENDPOINT`
  (or `..._TRACES_ENDPOINT`) is set, else nothing (the specification's default is `otlp`; a local stack
  without a collector would only log export failures). Any other name refuses to start, naming it.
- `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (`service.name=...,k=v`) set the resource; without
  them `service.name` is `sluice-<service>`. The attribute `sluice.service` always names the service.
- `SLUICE_TRACE_FILE` set: one JSON object per finished span, appended to that file. Tests that run
  several processes point them all at one file and read the spans back with `read_span_file`.
- Tests in one process add an `InMemorySpanExporter` to the provider `setup_tracing` returns.
`describe_tracing(env)` says in one line where traces go (the `sluice up` banner prints it).

Nothing is recorded for nobody: while a process has no span processor (no exporter, no trace file, no test's
exporter), a trace it would start itself is not sampled (`_RootsWhenExported`): its spans are no-ops and the
context it propagates says "not sampled", so the whole request costs no span work anywhere, as head sampling
from a root with `OTEL_TRACES_SAMPLER=always_off` would. A span continuing a sampled trace from elsewhere (a
client's or another service's traceparent) is still sampled by `OTEL_TRACES_SAMPLER` (default: the parent's
decision), so a process without an exporter never breaks a trace that others export.

The OpenTelemetry global tracer provider can be set only once per process, so `setup_tracing` is
idempotent: a second call (another service hosted in the same test process) returns the same provider.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "ERROR_STATUSES", "GEN_AI_OPERATION_NAME", "GEN_AI_REQUEST_MODEL", "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_ID", "GEN_AI_RESPONSE_MODEL", "GEN_AI_USAGE_INPUT_TOKENS", "GEN_AI_USAGE_OUTPUT_TOKENS",
    "TRACE_EXPORTERS", "TRACE_FIELDS", "JsonLinesSpanExporter", "describe_tracing", "end_request_span",
    "extract_fields", "extract_metadata", "get_tracer", "inject_fields", "inject_metadata", "link_to", "read_span_file", "setup_tracing",
    "trace_exporters", "trace_resource",
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


TRACE_EXPORTERS = ("otlp", "console", "none")
"""The values OTEL_TRACES_EXPORTER may list."""


def trace_exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters `env` asks for (see the module docstring); () for none.

    Raises ValueError naming OTEL_TRACES_EXPORTER and the unknown exporter."""
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        otlp = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return ("otlp",) if otlp else ()
    names = tuple(dict.fromkeys(name.strip().lower() for name in raw.split(",") if name.strip()))
    unknown = [name for name in names if name not in TRACE_EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER={raw!r}: unknown exporter {unknown[0]!r} "
                         f"(known: {', '.join(TRACE_EXPORTERS)})")
    return () if "none" in names else names


def describe_tracing(env: Mapping[str, str]) -> str:
    """One line saying where the services' traces go under `env`, and how to see them when they go nowhere."""
    try:
        exporters = trace_exporters(env)
    except ValueError as exc:
        return f"traces: not exported ({exc})"
    places = []
    if "otlp" in exporters:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") \
            or "http://localhost:4317"
        places.append(f"OTLP to {endpoint}")
    if "console" in exporters:
        places.append("one JSON line per span in each service's log")
    if env.get("SLUICE_TRACE_FILE"):
        places.append(f"JSON lines in {env['SLUICE_TRACE_FILE']}")
    if places:
        return "traces: " + "; ".join(places)
    return ("traces: not exported (OTEL_TRACES_EXPORTER=console puts them in each service's log; "
            "OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:4317 sends them to a collector or Jaeger)")


def trace_resource(service_name: str) -> Resource:
    """The resource of this process's spans: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, else `service_name`."""
    from opentelemetry.sdk.resources import OTELResourceDetector

    attributes: dict[str, str] = {"sluice.service": service_name}
    if "service.name" not in OTELResourceDetector().detect().attributes:
        attributes["service.name"] = service_name
    return Resource.create(attributes)


def _processors(env: Mapping[str, str]) -> list[SpanProcessor]:
    """The span processors `env` asks for. Raises RuntimeError naming the variable that is wrong."""
    try:
        exporters = trace_exporters(env)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc
    processors: list[SpanProcessor] = []
    if "otlp" in exporters:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError(
                "OTLP trace export is asked for (OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT) but the "
                "package opentelemetry-exporter-otlp-proto-grpc is not installed; install it or unset them") from exc
        processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in exporters:
        # Simple (synchronous): a local run's spans are in the log at once, even if the process is killed.
        processors.append(SimpleSpanProcessor(ConsoleSpanExporter(
            out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n")))
    if env.get("SLUICE_TRACE_FILE"):
        # Simple (synchronous) so that spans are on disk even if the process is killed later.
        processors.append(SimpleSpanProcessor(JsonLinesSpanExporter(env["SLUICE_TRACE_FILE"])))
    return processors


class _Provider(TracerProvider):
    """The SDK's provider, knowing whether any span processor was added (so whether a span can go anywhere)."""

    exporting = False

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.exporting = True


class _RootsWhenExported(Sampler):
    """`inner`'s decision, except that a trace this process starts itself is dropped while `provider` has no span
    processor (see the module docstring). Measured: the path's CPU per streamed token at concurrency 256 fell
    ~5% with `OTEL_TRACES_SAMPLER=always_off` against recording spans nobody exports (docs/benchmarks.md)."""

    def __init__(self, inner: Sampler, provider: _Provider) -> None:
        self.inner = inner
        self.provider = provider

    def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                      kind: trace.SpanKind | None = None, attributes: Any = None, links: Any = None,
                      trace_state: trace.TraceState | None = None) -> SamplingResult:
        if not self.provider.exporting and not trace.get_current_span(parent_context).get_span_context().is_valid:
            return SamplingResult(Decision.DROP)
        return self.inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RootsWhenExported{{{self.inner.get_description()}}}"


def setup_tracing(service_name: str) -> TracerProvider:
    """Install (once per process) and return the SDK tracer provider with the exporters the environment asks for.

    Raises RuntimeError when OTEL_TRACES_EXPORTER names an unknown exporter, or OTLP is asked for but its
    exporter is not installed.
    """
    global _provider
    with _setup_lock:
        if _provider is not None:
            return _provider
        provider = _Provider(resource=trace_resource(service_name))  # OTEL_TRACES_SAMPLER, else parent-based
        provider.sampler = _RootsWhenExported(provider.sampler, provider)
        for processor in _processors(os.environ):
            provider.add_span_processor(processor)
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
