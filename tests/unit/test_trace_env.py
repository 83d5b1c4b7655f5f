"""Traces follow the OpenTelemetry standard environment variables, and say where they go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.telemetry import describe_tracing, trace_exporters

ROOT = Path(__file__).resolve().parents[2]
SPAN = "from sluice.telemetry import setup_tracing, get_tracer; setup_tracing('sluice-router'); " \
       "get_tracer('t').start_span('probe').end()"


@pytest.mark.parametrize("env, expected", [
    ({}, ()), ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)), ({"OTEL_TRACES_EXPORTER": " Console , otlp"}, ("console", "otlp")),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ()),
])
def test_the_exporters_are_those_the_standard_variables_name(env: dict[str, str], expected: tuple[str, ...]) -> None:
    """OTEL_TRACES_EXPORTER picks the exporters (none wins); unset, an OTLP endpoint means otlp, else none."""
    assert trace_exporters(env) == expected


def test_an_unknown_exporter_is_refused_by_name() -> None:
    """A typo in OTEL_TRACES_EXPORTER is an error naming the variable and the value, never silently ignored."""
    with pytest.raises(ValueError, match=r"OTEL_TRACES_EXPORTER='jaeger': unknown exporter 'jaeger'"):
        trace_exporters({"OTEL_TRACES_EXPORTER": "jaeger"})


def test_the_banner_line_says_where_traces_go_or_how_to_see_them() -> None:
    """Nowhere: the line names the variables to set; otherwise it names the destination."""
    assert "OTEL_TRACES_EXPORTER=console" in describe_tracing({})
    assert describe_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}) == "traces: OTLP to http://jaeger:4317"
    assert "each service's log" in describe_tracing({"OTEL_TRACES_EXPORTER": "console"})


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "SLUICE_TRACE_FILE"}
    return subprocess.run([sys.executable, "-c", SPAN], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, "PYTHONPATH": str(ROOT), **env})


def test_console_exporter_writes_one_json_line_per_span_with_the_standard_resource() -> None:
    """OTEL_TRACES_EXPORTER=console prints the span on stderr as one JSON line; OTEL_SERVICE_NAME and
    OTEL_RESOURCE_ATTRIBUTES set its resource, and sluice.service still names the service."""
    done = _run({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "edge-router",
                 "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=staging"})
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("{")]
    span = json.loads(line)
    assert span["name"] == "probe"
    assert span["resource"]["attributes"] == {**span["resource"]["attributes"], "service.name": "edge-router",
                                              "deployment.environment": "staging", "sluice.service": "sluice-router"}


def test_without_a_service_name_the_sluice_name_is_used() -> None:
    """No OTEL_SERVICE_NAME: service.name is sluice-<service>."""
    done = _run({"OTEL_TRACES_EXPORTER": "console"})
    span = json.loads(next(line for line in done.stderr.splitlines() if line.startswith("{")))
    assert span["resource"]["attributes"]["service.name"] == "sluice-router"


def test_a_service_refuses_to_start_on_an_unknown_exporter(tmp_path: Path) -> None:
    """python -m router_svc with OTEL_TRACES_EXPORTER=jaeger exits 2 with the variable named, before serving."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-m", "router_svc", "--port", "0", "--redis-url", "redis://127.0.0.1:1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, "PYTHONPATH": str(ROOT), "OTEL_TRACES_EXPORTER": "jaeger"})
    assert done.returncode == 2, done.stderr
    assert "OTEL_TRACES_EXPORTER='jaeger': unknown exporter 'jaeger'" in done.stderr


_UNEXPORTED = """
import json
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sluice.telemetry import get_tracer, inject_metadata, setup_tracing
provider = setup_tracing('sluice-admission')
tracer = get_tracer('t')
out = {}
root = tracer.start_span('root')
out['root_recording'] = root.is_recording()
with trace.use_span(root):
    out['propagated'] = dict(inject_metadata()).get('traceparent', '')
remote = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
    0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))))
out['sampled_child_recording'] = tracer.start_span('child', context=remote).is_recording()
exporter = InMemorySpanExporter()
provider.add_span_processor(SimpleSpanProcessor(exporter))
later = tracer.start_span('later')
out['root_recording_once_exported'] = later.is_recording()
later.end()
out['exported'] = [span.name for span in exporter.get_finished_spans()]
print(json.dumps(out))
"""


def test_a_process_that_exports_nothing_samples_no_trace_of_its_own() -> None:
    """With no exporter, a root span is a no-op and propagates "not sampled" (no span work for nobody); a span
    continuing someone's sampled trace is still recorded; once a processor is added, roots are recorded again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SLUICE_TRACE"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _UNEXPORTED], env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    out = json.loads(done.stdout)
    assert out["root_recording"] is False
    version, trace_id, _span_id, flags = out["propagated"].split("-")
    assert int(trace_id, 16) and not int(flags, 16) & 0x01  # a valid trace id, flagged not sampled
    assert out["sampled_child_recording"] is True
    assert out["root_recording_once_exported"] is True and out["exported"] == ["later"]
