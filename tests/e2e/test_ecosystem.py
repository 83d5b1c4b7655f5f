"""End to end, as operators' tools see a stack: Prometheus names (Sluice's, vLLM's, OpenTelemetry GenAI's)
scraped from every service, gRPC server reflection on every service, and the spans a tracing UI reads.

One stack (cost-model backend, emulated time) for the module, started with metrics on free ports as
`sluice up` starts it; a few requests finish and one is cancelled before the checks.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from sluice import client as sdk
from sluice import services
from sluice.prom import TTFT_BUCKETS
from sluice.telemetry import read_span_file
from sluice_tools.stack import Proc, Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "llama-3-8b"
PROMPT = list(range(10, 74))  # 64 tokens
MAX_TOKENS = 6
FINISHED = 3

# Each exported name (as scraped: counters with _total, histograms by their _count) -> its labels.
SCHEDULER_VLLM = {
    "vllm:num_requests_waiting": {"model_name": MODEL},
    "vllm:num_requests_running": {"model_name": MODEL},
    "vllm:kv_cache_usage_perc": {"model_name": MODEL},
    "vllm:time_to_first_token_seconds_count": {"model_name": MODEL},
    "vllm:inter_token_latency_seconds_count": {"model_name": MODEL},
    "vllm:e2e_request_latency_seconds_count": {"model_name": MODEL},
    "vllm:request_queue_time_seconds_count": {"model_name": MODEL},
    "vllm:prompt_tokens_total": {"model_name": MODEL},
    "vllm:generation_tokens_total": {"model_name": MODEL},
    "vllm:num_preemptions_total": {"model_name": MODEL},
    "vllm:prefix_cache_queries_total": {"model_name": MODEL},
    "vllm:prefix_cache_hits_total": {"model_name": MODEL},
    "vllm:request_success_total": {"model_name": MODEL, "finished_reason": "length"},
}
GEN_AI = {"gen_ai_operation_name": "text_completion", "gen_ai_request_model": MODEL}
ADMISSION_GEN_AI = {
    "gen_ai_server_time_to_first_token_seconds_count": GEN_AI,
    "gen_ai_server_time_per_output_token_seconds_count": GEN_AI,
    "gen_ai_server_request_duration_seconds_count": {**GEN_AI, "error_type": ""},
    "gen_ai_client_token_usage_count": {**GEN_AI, "gen_ai_token_type": "output"},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A cost-model stack with metrics on free ports and spans to a file; FINISHED requests done, one cancelled."""
    run_dir = tmp_path_factory.mktemp("eco")
    spans = run_dir / "spans.jsonl"
    config = StackConfig(replicas=1, backend="costmodel", model=MODEL, emulate_time=True, run_dir=run_dir,
                         env=(("SLUICE_TRACE_FILE", str(spans)),))
    with Stack(config) as running:
        with sdk.Client(running.endpoint, api_key=running.api_key) as client:
            for _ in range(FINISHED):
                client.generate_text(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=60)
            stream = client.generate(PROMPT, max_tokens=1500, ignore_eos=True, timeout=60)
            first = next(stream)
            client.cancel(first.request_id)
            with pytest.raises(sdk.Cancelled):
                for _ in stream:
                    pass
        yield running


def _samples(proc: Proc) -> list[Any]:
    assert proc.metrics_url.startswith("http://127.0.0.1:"), (proc.name, proc.metrics_url)
    with urllib.request.urlopen(proc.metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _value(samples: list[Any], name: str, labels: dict[str, str]) -> float | None:
    """Return the value of the sample `name` whose labels include `labels` (None when there is none)."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k, "") == v for k, v in labels.items()):
            return float(sample.value)
    return None


def _settled(condition: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


def test_scheduler_exports_vllm_names_with_model_name_beside_its_own(stack: Stack) -> None:
    """The replica's scheduler exports every vLLM name Sluice measures, labelled model_name, with the values
    its own sluice_* names carry, and counts the cancel as vLLM's finished_reason "abort"."""
    samples = _settled(lambda: (s := _samples(stack.schedulers[0]))
                       and _value(s, "vllm:request_success_total", {"finished_reason": "abort"}) and s)
    missing = {name: labels for name, labels in SCHEDULER_VLLM.items() if _value(samples, name, labels) is None}
    assert not missing, missing
    assert _value(samples, "vllm:request_success_total", {"finished_reason": "length"}) == FINISHED
    assert _value(samples, "vllm:request_success_total", {"finished_reason": "abort"}) == 1
    # vLLM counts a request's prompt once its prefill completes: all four got a first token.
    assert _value(samples, "vllm:prompt_tokens_total", {}) == 4 * len(PROMPT)
    assert _value(samples, "vllm:generation_tokens_total", {}) >= FINISHED * MAX_TOKENS + 1
    assert 0.0 <= (_value(samples, "vllm:kv_cache_usage_perc", {}) or 0.0) <= 1.0
    twins = [("vllm:time_to_first_token_seconds_count", "sluice_time_to_first_token_seconds_count"),
             ("vllm:prefix_cache_queries_total", "sluice_prefix_query_tokens_total"),
             ("vllm:prefix_cache_hits_total", "sluice_prefix_hit_tokens_total"),
             ("vllm:e2e_request_latency_seconds_count", "sluice_request_duration_seconds_count")]
    for vllm_name, own in twins:
        assert _value(samples, vllm_name, {}) == _value(samples, own, {}), (vllm_name, own)
    assert _value(samples, "vllm:time_to_first_token_seconds_count", {}) == 4
    assert _value(samples, "vllm:request_queue_time_seconds_count", {}) == 4


def test_admission_exports_the_genai_server_metrics(stack: Stack) -> None:
    """Admission exports the OpenTelemetry GenAI server metrics (and token usage) with their attributes as
    labels: TTFT and TPOT for the finished requests, durations with error_type for the cancelled one."""
    assert stack.admission is not None
    cancelled = {**GEN_AI, "error_type": "CANCELLED"}
    samples = _settled(lambda: (s := _samples(stack.admission))
                       and _value(s, "gen_ai_server_request_duration_seconds_count", cancelled) and s)
    missing = {name: labels for name, labels in ADMISSION_GEN_AI.items() if _value(samples, name, labels) is None}
    assert not missing, missing
    assert _value(samples, "gen_ai_server_time_to_first_token_seconds_count", GEN_AI) == FINISHED
    assert _value(samples, "gen_ai_server_request_duration_seconds_count", {**GEN_AI, "error_type": ""}) == FINISHED
    assert _value(samples, "gen_ai_server_request_duration_seconds_count", cancelled) == 1
    assert _value(samples, "gen_ai_client_token_usage_sum", {**GEN_AI, "gen_ai_token_type": "input"}) == 4 * len(PROMPT)
    # The GenAI conventions' bucket boundaries: TTFT from 1 ms to 10 s, token usage in powers of 4.
    assert _bounds(samples, "gen_ai_server_time_to_first_token_seconds_bucket") == [*TTFT_BUCKETS, math.inf]
    assert _bounds(samples, "gen_ai_client_token_usage_bucket") == [*(4.0 ** i for i in range(14)), math.inf]


def _bounds(samples: list[Any], bucket_name: str) -> list[float]:
    """Return the distinct `le` boundaries of a histogram's buckets, in order."""
    return sorted({float(s.labels["le"]) for s in samples if s.name == bucket_name})


def test_every_service_serves_metrics_on_the_port_it_reports(stack: Stack) -> None:
    """With --metrics-port 0, every service binds a free port, prints its URL, and serves Sluice's names there."""
    own = {"router": "sluice_routes_total", "worker-0": "sluice_worker_rounds_total",
           "scheduler-0": "sluice_rounds_total", "admission": "sluice_admission_requests_total"}
    urls = {proc.name: proc.metrics_url for proc in stack.procs}
    assert len(set(urls.values())) == len(own), urls
    for proc in stack.procs:
        assert any(s.name == own[proc.name] for s in _samples(proc)), proc.name
        assert f"metrics {proc.metrics_url}" in stack.describe()


@pytest.mark.parametrize(("role", "service"), [("router", services.ROUTER), ("worker", services.WORKER),
                                               ("scheduler", services.SCHEDULER), ("admission", services.ADMISSION)])
def test_reflection_lists_and_describes_each_services_api(stack: Stack, role: str, service: str) -> None:
    """A reflection client lists the service's own API, health and reflection, and resolves its methods."""
    proc = next(p for p in stack.procs if p.name.startswith(role))
    with grpc.insecure_channel(proc.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        listed = set(database.get_services())
        methods = DescriptorPool(database).FindServiceByName(service).methods_by_name
    assert listed == {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert methods, service


def _spans(stack: Stack) -> list[dict[str, Any]]:
    return read_span_file(Path(dict(stack.config.env)["SLUICE_TRACE_FILE"]))


def test_worker_round_spans_link_to_the_requests_they_served(stack: Stack) -> None:
    """Each finished request's replica span is linked from at least one worker round per output token."""
    def linked() -> dict[str, int] | None:
        spans = _spans(stack)
        replica = {s["span_id"]: s["attributes"]["sluice.request_id"] for s in spans
                   if s["name"] == "replica.request" and s["attributes"].get("sluice.status") == "FINISHED_LENGTH"}
        rounds = [s for s in spans if s["name"] == "worker.round"]
        counts = {rid: 0 for rid in replica.values()}
        for span in rounds:
            assert span["service"] == "sluice-worker" and span["parent_span_id"] == ""
            for link in span["links"]:
                if link["span_id"] in replica:
                    assert link["attributes"]["sluice.request_id"] == replica[link["span_id"]]
                    counts[replica[link["span_id"]]] += 1
        return counts if len(counts) == FINISHED and min(counts.values()) >= MAX_TOKENS else None

    assert _settled(linked), _spans(stack)[-5:]


def test_statuses_are_spelled_once_and_a_cancel_is_not_an_error(stack: Stack) -> None:
    """Admission's GenAI root span and the replica span give each request the same RequestStatus name, and the
    cancelled request's spans are not ERROR; the root is named "text_completion {model}" with GenAI attributes."""
    def by_request() -> dict[str, dict[str, dict[str, Any]]] | None:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for span in _spans(stack):
            rid = span["attributes"].get("sluice.request_id")
            if rid and span["name"] in (f"text_completion {MODEL}", "replica.request"):
                out.setdefault(rid, {})[span["name"]] = span
        complete = [spans for spans in out.values() if len(spans) == 2]
        return out if len(complete) == FINISHED + 1 else None

    requests = _settled(by_request)
    assert requests, "spans missing"
    statuses = []
    for spans in requests.values():
        root, replica = spans[f"text_completion {MODEL}"], spans["replica.request"]
        assert root["attributes"]["sluice.status"] == replica["attributes"]["sluice.status"]
        assert root["attributes"]["gen_ai.operation.name"] == "text_completion"
        assert root["attributes"]["gen_ai.request.model"] == MODEL
        assert root["attributes"]["gen_ai.usage.input_tokens"] == len(PROMPT)
        assert root["status"] == replica["status"] == "UNSET"
        statuses.append(root["attributes"]["sluice.status"])
    assert sorted(statuses) == ["CANCELLED"] + ["FINISHED_LENGTH"] * FINISHED
