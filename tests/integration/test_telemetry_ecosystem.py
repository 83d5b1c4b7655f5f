"""Telemetry in the shapes operators' tools read: vLLM metric names, worker round spans linked to requests,
one spelling of a request's status on spans, in-process (in-memory span exporter, a real worker server)."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from scheduler_svc.publisher import Publisher
from scheduler_svc.reporting import MAX_ROUND_TRACES, Reporter
from scheduler_svc.server import make_core
from sluice import convert, telemetry
from sluice.prom import SchedulerMetrics
from sluice.types import CoreEvents, RoundPlan, SamplingParams, ScheduledSeq
from sluice.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from worker_svc.costmodel import CostModel
from worker_svc.server import WorkerRuntime, start_worker_server


def _seq(request_id: str, prefill: bool = False) -> ScheduledSeq:
    tokens = (1, 2, 3, 4) if prefill else (7,)
    return ScheduledSeq(request_id, 0, tokens, 0 if prefill else 5, (0,), SamplingParams(max_tokens=4), True,
                        0 if prefill else 1)


def test_vllm_names_carry_the_bound_model_and_vllm_finish_reasons() -> None:
    """Each quantity is recorded under Sluice's name and vLLM's (labelled with the bound model); finish
    reasons map to vLLM's; binding another model drops the previous label's series."""
    metrics = SchedulerMetrics()
    metrics.bind_model("m1")
    metrics.ttft.observe(0.03)
    metrics.queue_length.set(5)
    for reason in ("stop", "length", "cancelled", "timeout", "error"):
        metrics.request_success(reason)
    value = metrics.registry.get_sample_value
    assert value("sluice_time_to_first_token_seconds_count") == 1
    assert value("vllm:time_to_first_token_seconds_count", {"model_name": "m1"}) == 1
    assert value("vllm:num_requests_waiting", {"model_name": "m1"}) == value("sluice_queue_length") == 5
    assert value("vllm:num_requests_waiting", {"model_name": ""}) is None
    reasons = {r: value("vllm:request_success_total", {"model_name": "m1", "finished_reason": r})
               for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 1, "length": 1, "abort": 2, "error": 1}
    metrics.bind_model("m2")
    assert value("vllm:time_to_first_token_seconds_count", {"model_name": "m1"}) is None
    assert value("vllm:num_requests_waiting", {"model_name": "m2"}) == 0


def _reporter() -> Reporter:
    info = worker_pb2.WorkerInfo(num_blocks=64, block_size=4, model_id="m", max_model_len=256)
    return Reporter(make_core(info, "r"), Publisher(None), SchedulerMetrics(), "r")  # type: ignore[arg-type]


def test_rounds_carry_sampled_requests_only_bounded_and_prefills_first(span_exporter) -> None:  # type: ignore[no-untyped-def]
    """A round carries at most MAX_ROUND_TRACES trace contexts, prefill chunks first, none of unsampled
    requests; with no sampled request tracked it carries none."""
    reporter = _reporter()
    unsampled = NonRecordingSpan(SpanContext(0x1234, 0x99, is_remote=False, trace_flags=TraceFlags(0)))
    reporter.track("quiet", "o", unsampled, common_pb2.LifecycleTimestamps(), 0.0)
    assert reporter.round_traces(RoundPlan(1, (_seq("quiet"),))) == []
    tracer = telemetry.get_tracer("test")
    for i in range(MAX_ROUND_TRACES + 8):
        reporter.track(f"d{i}", "o", tracer.start_span(f"s{i}"), common_pb2.LifecycleTimestamps(), 0.0)
    reporter.track("new", "o", tracer.start_span("new"), common_pb2.LifecycleTimestamps(), 0.0)
    decodes = tuple(_seq(f"d{i}") for i in range(MAX_ROUND_TRACES + 8))
    traces = reporter.round_traces(RoundPlan(2, (_seq("quiet"), *decodes, _seq("new", prefill=True))))
    assert len(traces) == MAX_ROUND_TRACES and traces[0].request_id == "new"
    assert "quiet" not in {t.request_id for t in traces}
    assert all(t.traceparent.startswith("00-") for t in traces)


def test_worker_round_span_links_each_request_it_carries(span_exporter) -> None:  # type: ignore[no-untyped-def]
    """A round with trace contexts gets one `worker.round` span (a root) linked to each request's span, a
    malformed context is skipped, and a round without contexts makes no span."""
    tracer = telemetry.get_tracer("test")
    spans = {rid: tracer.start_span(rid) for rid in ("a", "b")}

    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200")))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            plan = convert.plan_to_proto(RoundPlan(3, (_seq("a"), _seq("b"))))
            await stub.Execute(plan)  # no trace contexts: no span
            for rid, span in spans.items():
                fields = telemetry.inject_fields(trace.set_span_in_context(span))
                plan.traces.add(request_id=rid, traceparent=fields["traceparent"])
            plan.traces.add(request_id="bad", traceparent="00-nonsense")
            call = stub.ExecuteStream()
            await call.write(plan)
            assert (await call.read()).round_id == 3
            await call.done_writing()
        await worker.stop()

    asyncio.run(body())
    [round_span] = [s for s in span_exporter.get_finished_spans() if s.name == "worker.round"]
    assert round_span.parent is None and round_span.attributes["sluice.round_id"] == 3
    linked = {(link.context.span_id, link.attributes["sluice.request_id"]) for link in round_span.links}
    assert linked == {(span.get_span_context().span_id, rid) for rid, span in spans.items()}


def test_a_refused_sequence_is_an_event_of_its_rounds_span(span_exporter) -> None:  # type: ignore[no-untyped-def]
    """A traced round with one sequence the worker refuses (a token id past the vocabulary) gets one `seq_refused`
    event naming the request and the field; the round's span is not an error (the rest of it ran)."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200")))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            bad = ScheduledSeq("b", 0, (10**9,), 5, (0,), SamplingParams(max_tokens=4), True, 1)
            plan = convert.plan_to_proto(RoundPlan(4, (_seq("a"), bad)))
            span = telemetry.get_tracer("test").start_span("a")
            plan.traces.add(request_id="a", traceparent=telemetry.inject_fields(
                trace.set_span_in_context(span))["traceparent"])
            result = await worker_pb2_grpc.WorkerServiceStub(channel).Execute(plan)
            assert [o.request_id for o in result.outputs] == ["a"] and [r.request_id for r in result.refused] == ["b"]
        await worker.stop()

    asyncio.run(body())
    [round_span] = [s for s in span_exporter.get_finished_spans() if s.name == "worker.round"]
    assert [(e.name, e.attributes["sluice.request_id"], e.attributes["sluice.field"]) for e in round_span.events] \
        == [("seq_refused", "b", "seqs[1].token_ids")]
    assert round_span.status.status_code.name == "UNSET"


def test_a_cancel_ends_a_request_span_without_error_and_a_failure_with_one(span_exporter) -> None:  # type: ignore[no-untyped-def]
    """end_request_span writes the RequestStatus name and makes ERROR only failures, timeouts and rejections."""
    tracer = telemetry.get_tracer("test")
    for status in ("FINISHED_STOP", "CANCELLED", "FAILED", "TIMED_OUT"):
        telemetry.end_request_span(tracer.start_span(status), status, "why")
    got = {s.name: (s.attributes["sluice.status"], s.status.status_code.name, s.attributes.get("error.type"))
           for s in span_exporter.get_finished_spans()}
    assert got == {"FINISHED_STOP": ("FINISHED_STOP", "UNSET", None), "CANCELLED": ("CANCELLED", "UNSET", None),
                   "FAILED": ("FAILED", "ERROR", "FAILED"), "TIMED_OUT": ("TIMED_OUT", "ERROR", "TIMED_OUT")}


def test_gauges_follow_the_core_when_only_changes_are_written() -> None:
    """The replica's gauges (both names) equal the core's stats after every hand-over, though only what changed
    is written: the first hand-over writes all (free blocks are not 0), a value that goes back is written back."""
    reporter = _reporter()
    core, value = reporter.core, reporter.metrics.registry.get_sample_value
    reporter.metrics.bind_model("m")

    def check() -> None:
        stats = core.stats()
        assert (value("sluice_queue_length"), value("sluice_running_requests"), value("sluice_kv_blocks_used"),
                value("sluice_kv_blocks_free"), value("sluice_kv_blocks_cached")) == (
            stats.waiting, stats.running, stats.kv_blocks_used, stats.kv_blocks_free, stats.kv_blocks_cached)
        twin = {"model_name": "m"}
        assert (value("vllm:num_requests_waiting", twin), value("vllm:num_requests_running", twin)) == (
            stats.waiting, stats.running)
        assert value("vllm:kv_cache_usage_perc", twin) == stats.kv_blocks_used / stats.kv_blocks_total

    reporter.handle(CoreEvents(), 0.0)
    check()
    assert value("sluice_kv_blocks_free") == 64
    msg = scheduler_pb2.SubmitRequest(request_id="a", tenant="t", owner="o", prompt_token_ids=list(range(1, 21)),
                                      sampling=common_pb2.SamplingParams(max_tokens=4))
    core.submit(convert.new_request_from_proto(msg, 1.0, 0), 1.0)
    reporter.handle(core.take_events(), 1.0)
    check()
    assert value("sluice_queue_length") == 1
    plan = core.schedule(2.0)
    reporter.handle(core.take_events(), 2.0)
    check()
    assert value("sluice_running_requests") == 1 and value("sluice_kv_blocks_used") > 0
    reporter.handle(core.on_round_lost(plan.round_id, 3.0), 3.0)  # back to waiting, its blocks freed
    check()
    assert (value("sluice_queue_length"), value("sluice_running_requests"), value("sluice_kv_blocks_used")) == (1, 0, 0)
