"""Trace propagation over gRPC metadata and Redis fields, the JSON-lines span file, and Prometheus metrics."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request

from opentelemetry import trace

from sluice.prom import TTFT_BUCKETS, SchedulerMetrics, serve_metrics
from sluice.telemetry import (
    extract_fields,
    extract_metadata,
    get_tracer,
    inject_fields,
    inject_metadata,
    read_span_file,
    setup_tracing,
)


def test_metadata_and_fields_round_trip_the_current_span(span_exporter) -> None:  # type: ignore[no-untyped-def]
    """The span context injected into gRPC metadata or Redis fields (bytes or str) extracts to the same
    trace and span ids; nothing is injected outside a span."""
    assert inject_metadata() == [] and inject_fields() == {}
    with get_tracer("test").start_as_current_span("parent") as span:
        ctx = span.get_span_context()
        metadata = inject_metadata()
        fields = inject_fields()
    assert [k for k, _ in metadata] == ["traceparent"] and set(fields) == {"traceparent"}
    from_grpc = trace.get_current_span(extract_metadata(metadata)).get_span_context()
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()} | {b"p": b"\x00\x01"}
    from_redis = trace.get_current_span(extract_fields(as_bytes)).get_span_context()
    assert (from_grpc.trace_id, from_grpc.span_id) == (ctx.trace_id, ctx.span_id)
    assert (from_redis.trace_id, from_redis.span_id) == (ctx.trace_id, ctx.span_id)
    assert from_redis.is_remote


def test_setup_tracing_is_idempotent_in_one_process() -> None:
    """A second service set up in the same process shares the first provider instead of failing."""
    assert setup_tracing("one") is setup_tracing("two")


_CHILD = textwrap.dedent("""
    import sys
    from sluice.telemetry import extract_fields, get_tracer, setup_tracing
    provider = setup_tracing("child-service")
    ctx = extract_fields({"traceparent": sys.argv[1]})
    with get_tracer("child").start_as_current_span("child-work", context=ctx) as span:
        span.add_event("did-something", {"n": 3})
    provider.shutdown()
""")


def test_child_process_spans_land_in_the_shared_trace_file(trace_file, subprocess_env) -> None:  # type: ignore[no-untyped-def]
    """A process with SLUICE_TRACE_FILE writes its spans as JSON lines there, continuing a trace handed to
    it as a traceparent, with its service name and events."""
    trace_id, parent_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    env = dict(subprocess_env, SLUICE_TRACE_FILE=str(trace_file))
    subprocess.run([sys.executable, "-c", _CHILD, f"00-{trace_id}-{parent_span}-01"], env=env, check=True,
                   timeout=60)
    [span] = read_span_file(trace_file)
    assert (span["name"], span["service"], span["trace_id"], span["parent_span_id"]) == (
        "child-work", "child-service", trace_id, parent_span)
    assert span["events"][0]["name"] == "did-something" and span["events"][0]["attributes"] == {"n": 3}
    assert span["end_ns"] >= span["start_ns"] > 0


def test_metrics_endpoint_serves_genai_buckets() -> None:
    """A service registry served over HTTP exposes the TTFT histogram with the GenAI bucket boundaries and
    the counters by label."""
    metrics = SchedulerMetrics()
    metrics.ttft.observe(0.03)
    metrics.rejections.labels("queue_full").inc()
    port = serve_metrics(metrics.registry, 0, addr="127.0.0.1")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for bound in TTFT_BUCKETS:
        assert f'sluice_time_to_first_token_seconds_bucket{{le="{bound}"}}' in body
    assert 'sluice_time_to_first_token_seconds_bucket{le="0.04"} 1.0' in body
    assert 'sluice_rejections_total{reason="queue_full"} 1.0' in body
