"""Prometheus metrics: one registry per service, served by `serve_metrics(registry, port, addr)`.

The endpoint answers the classic text format 0.0.4, or OpenMetrics 1.0.0 when the scraper prefers it, with
every name exactly as registered (`vllm:*` keeps its colon on Prometheus 2.x and 3.x alike; `exposition`).

Three families, each quantity measured once and recorded under every name that means it (`Fanout`):
- Sluice's own `sluice_*` names (every service).
- vLLM's `vllm:*` names with the `model_name` label, on the scheduler (a replica is what a vLLM engine is
  to llm-d's inference scheduler, KEDA/HPA rules and vLLM dashboards). Names, types, labels and meanings
  follow vLLM's V1 metrics: docs/design/metrics.md and docs/usage/metrics.md of vllm-project/vllm
  (https://docs.vllm.ai/en/stable/usage/metrics/), finish reasons as its FINISH_REASON_STRINGS
  (vllm/v1/engine/__init__.py). Only quantities Sluice measures are exported.
- The OpenTelemetry GenAI model-server metrics, on admission (the server clients call), under the names
  the OTel-to-Prometheus translation gives them (dots to underscores, unit `s` as `_seconds`, `{token}`
  dropped), with the attributes as labels: open-telemetry/semantic-conventions
  docs/gen-ai/gen-ai-metrics.md (v1.41.0).

Latency histograms of every family use the bucket boundaries the GenAI conventions advise for
`gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token` and
`gen_ai.server.request.duration`, so dashboards built for any of them agree.
Metric names are listed in docs/operations.md.

Counters of rare events (drains, migrations, re-routes, refusals, unreachable reports) export each known
label value at 0 from the start (`zero_series`): a dashboard panel or an alert on `rate(...)` then shows 0
rather than "no data", and the first event's increase is seen (a series born at 1 has no increase to rate).
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
from bisect import bisect_left
from collections import Counter as Counter_
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics_exposition

from sluice.types import RejectReason

log = logging.getLogger(__name__)

__all__ = [
    "REQUEST_DURATION_BUCKETS", "TOKEN_USAGE_BUCKETS", "TPOT_BUCKETS", "TTFT_BUCKETS", "VLLM_FINISH_REASONS",
    "AdmissionMetrics", "Fanout", "RequestOutcome", "RouterMetrics", "SchedulerMetrics", "WorkerMetrics", "choose_format",
    "exposition", "serve_metrics",
]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                            40.96, 81.92)
# gen_ai.client.token.usage: the GenAI conventions' boundaries (powers of 4 from 1 to 4^13).
TOKEN_USAGE_BUCKETS = tuple(float(4 ** i) for i in range(14))
# Tokenizing one prompt: microseconds for a chat turn, about a second for a 1 MiB prompt.
TOKENIZE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Rounds of a CPU engine or a modelled GPU: from sub-millisecond to seconds.
IDLE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.05, 0.25, 1.0)
ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

VLLM_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort",
                       "error": "error"}
"""Sluice finish reason -> vLLM's `finished_reason` label (vLLM counts a timed-out request as aborted)."""


class Fanout:
    """One measurement recorded under several names (Sluice's own and its standard twins)."""

    __slots__ = ("metrics",)

    def __init__(self, *metrics: Any) -> None:
        self.metrics = metrics

    def observe(self, value: float) -> None:
        """Observe `value` in every histogram."""
        for metric in self.metrics:
            metric.observe(value)

    def observe_many(self, values: Sequence[float]) -> None:
        """Observe every one of `values` in every histogram: the same bucket counts, count and sum as one `observe`
        each, for one increment per bucket touched and one of the sum per histogram (a round's inter-token gaps;
        prometheus_client has no bulk observe, so this writes its histogram's own bucket and sum values)."""
        if not values:
            return
        total = sum(values)
        counted: dict[tuple[float, ...], Counter_[int]] = {}
        for metric in self.metrics:
            bounds = tuple(metric._upper_bounds)  # the same for both twins: counted once
            counts = counted.get(bounds)
            if counts is None:
                counts = counted[bounds] = Counter_(bisect_left(bounds, value) for value in values)
            metric._sum.inc(total)
            buckets = metric._buckets
            for index, count in counts.items():
                buckets[index].inc(count)

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` to every counter or gauge."""
        for metric in self.metrics:
            metric.inc(amount)

    def set(self, value: float) -> None:
        """Set every gauge to `value`."""
        for metric in self.metrics:
            metric.set(value)


OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _accepted(accept: str) -> list[tuple[float, str, dict[str, str]]]:
    """The media ranges of an Accept header as (q, type, parameters), best first (stable for equal q)."""
    ranges = []
    for position, part in enumerate(accept.split(",")):
        media, *raw = [token.strip() for token in part.split(";")]
        params = dict(token.split("=", 1) for token in raw if "=" in token)
        try:
            q = float(params.pop("q", "1"))
        except ValueError:
            q = 0.0
        if media and q > 0:
            ranges.append((-q, position, media.lower(), params))
    return [(-q, media, params) for q, _position, media, params in sorted(ranges)]


def choose_format(accept: str) -> str:
    """Return the exposition format, "openmetrics" or "text", to answer a scraper's Accept header with.

    OpenMetrics 1.0.0 when it is the scraper's best acceptable range and asks for no escaping other than
    `underscores` or `allow-utf-8` (every Sluice name is a legacy Prometheus name, colons included, which
    both leave as it is); otherwise the classic text format 0.0.4, which every Prometheus reads."""
    for _q, media, params in _accepted(accept):
        if media == "application/openmetrics-text":
            version, escaping = params.get("version", "1.0.0"), params.get("escaping", "underscores")
            if version == "1.0.0" and escaping in ("underscores", "allow-utf-8"):
                return "openmetrics"
        elif media in ("text/plain", "text/*", "*/*"):
            return "text"
    return "text"


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """Return (body, Content-Type) of `registry` for a scraper sending `accept`, with every name as registered.

    prometheus-client's own negotiation (0.26) writes OpenMetrics samples with `escaping=underscores` by its
    label-name rule, which turns the colons of `vllm:*` names into underscores: Prometheus 2.x, whose Accept
    header prefers OpenMetrics and names no escaping, then stores `vllm_num_requests_running`. Names need no
    escaping here (all are legacy-valid), so the OpenMetrics body is written unescaped; the text format
    0.0.4 is the answer to anything else."""
    if choose_format(accept) == "openmetrics":
        return openmetrics_exposition.generate_latest(registry, escaping=openmetrics_exposition.ALLOWUTF8), \
            OPENMETRICS_CONTENT_TYPE
    return generate_latest(registry), TEXT_CONTENT_TYPE


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if urlsplit(self.path).path not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served")
                return
            body, content_type = exposition(registry, self.headers.get("Accept", ""))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            """Quiet: a scrape every few seconds is not news."""

    return MetricsHandler


class _MetricsServer(ThreadingHTTPServer):
    """The metrics server, which takes a scraper that went away as a fact of life: a scrape timed out while this
    process was paused (SIGSTOP, a long GC, a loaded node) is answered after its scraper closed the connection,
    and the write fails. `socketserver` printed that traceback to stderr for each one; it is one debug line here.
    Other errors are logged with their traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        failure = sys.exc_info()[1]
        if isinstance(failure, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            log.debug("metrics scrape from %s: the scraper left before the answer (%s)", client_address, failure)
            return
        log.error("metrics scrape from %s failed", client_address, exc_info=True)


class _MetricsServerV6(_MetricsServer):
    address_family = socket.AF_INET6


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1",
                  ssl_context: ssl.SSLContext | None = None) -> int:
    """Serve `registry` at http://addr:port/metrics (https with `ssl_context`) in a daemon thread; return the
    bound port (port 0 picks one). The format follows the scraper's Accept header (`exposition`).

    Raises OSError when the port is taken or the address is not this machine's.
    """
    server_class = _MetricsServerV6 if ":" in addr else _MetricsServer
    server = server_class((addr, port), _handler(registry))
    server.daemon_threads = True
    if ssl_context is not None:
        server.socket = ssl_context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name=f"metrics-{port}", daemon=True).start()
    return int(server.server_address[1])


def zero_series(counter: Counter, label_values: Any) -> None:
    """Create the series of a one-label `counter` for each value in `label_values`, at 0."""
    for value in label_values:
        counter.labels(value)


DRAIN_OUTCOMES = ("finished", "handed_off")
"""How a replica's drain ends (`sluice_replica_drains_total{outcome}`)."""
UNREACHABLE_OUTCOMES = ("confirmed", "refuted", "unknown")
"""What the router made of a ReportUnreachable call (`sluice_router_unreachable_reports_total{outcome}`)."""
MIGRATION_FAILURE_REASONS = ("migration_limit", "no_replica")
"""Why a request ended FAILED instead of moving (`sluice_admission_migration_failures_total{reason}`)."""


ROUND_LINK_ERRORS = ("bad_preface", "frame_too_large", "not_a_plan", "forbidden", "no_preface")
"""Why a worker refused or dropped a round link (sluice.round_link.FrameError.reason; `not_a_result` is the
scheduler's side, logged there with the round it lost)."""
WORKER_LINKS = ("round_link", "grpc_stream", "grpc_unary")
"""How a scheduler sends its rounds to its worker (`sluice_scheduler_worker_link{kind}`)."""


class FrameTally:
    """Frames and bytes of round links, by direction: counted by each stream as plain ints (`frames_in`,
    `frames_out`, `bytes_in`, `bytes_out`; no lock on the round path) and summed when scraped, live streams and
    closed ones alike."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.prefix = prefix
        self._live: set[Any] = set()
        self._closed = [0, 0, 0, 0]
        registry.register(self)

    def track(self, stream: Any) -> None:
        """Count `stream`'s frames from now on (it counts from its start)."""
        self._live.add(stream)

    def untrack(self, stream: Any) -> None:
        """Keep what `stream` counted and stop reading it."""
        if stream in self._live:
            self._live.discard(stream)
            for i, value in enumerate(_frame_counts(stream)):
                self._closed[i] += value

    def totals(self) -> tuple[int, int, int, int]:
        """Return frames received, frames sent, bytes received, bytes sent so far."""
        sums = list(self._closed)
        for stream in list(self._live):
            for i, value in enumerate(_frame_counts(stream)):
                sums[i] += value
        return sums[0], sums[1], sums[2], sums[3]

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        frames_in, frames_out, bytes_in, bytes_out = self.totals()
        frames = CounterMetricFamily(f"{self.prefix}_frames", "Round-link frames, by direction.",
                                     labels=["direction"])
        frames.add_metric(["received"], frames_in)
        frames.add_metric(["sent"], frames_out)
        sizes = CounterMetricFamily(f"{self.prefix}_bytes", "Round-link payload bytes, by direction.",
                                    labels=["direction"])
        sizes.add_metric(["received"], bytes_in)
        sizes.add_metric(["sent"], bytes_out)
        return [frames, sizes]


def _frame_counts(stream: Any) -> tuple[int, int, int, int]:
    return stream.frames_in, stream.frames_out, stream.bytes_in, stream.bytes_out


@dataclass
class SchedulerMetrics:
    """Metrics of one replica's scheduler service: Sluice's names and vLLM's (labelled with `model_name`)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    model_name: str = ""
    """The served model, the vLLM metrics' `model_name` label; `bind_model` sets it once the worker said."""

    def __post_init__(self) -> None:
        r = self.registry
        self._ttft = Histogram("sluice_time_to_first_token_seconds", "Enqueue to first output token.",
                               buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("sluice_time_per_output_token_seconds",
                              "Mean time per output token after the first, per finished request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self._itl = Histogram("sluice_inter_token_latency_seconds", "Time between consecutive output tokens.",
                              buckets=TPOT_BUCKETS, registry=r)
        self._request_duration = Histogram("sluice_request_duration_seconds", "Enqueue to terminal state.",
                                           buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.round_duration = Histogram("sluice_round_duration_seconds",
                                        "Wall time of one scheduling round (plan, execute, result).",
                                        buckets=ROUND_BUCKETS, registry=r)
        self._kv_entries = Counter("sluice_kv_event_entries", "KV event entries this replica published on the kv stream "
                                   "(each one merges the events of the rounds within --kv-linger-ms).", registry=r)
        self._kv_entry_events = Counter("sluice_kv_event_entry_events", "KV events in those entries.", registry=r)
        self._spaced = Counter("sluice_publications_spaced", "Publications whose rounds waited --publish-interval-ms "
                               "(they came within it of the previous publication).", registry=r)
        self._spaced_batches = Counter("sluice_publications_spaced_batches", "Rounds' batches those publications "
                                       "carried (merged: each request's deltas of them as one).", registry=r)
        self.lease_sweep_late = Counter("sluice_owner_lease_sweep_late_seconds", "Seconds the owner-lease sweep woke "
                                        "late by, counted when more than its 0.5 s period: time this replica's loop "
                                        "did not run (stopped, starved, busy), added to every owner's lease.",
                                        registry=r)
        self.engine_stream_chunks = Counter("sluice_engine_stream_chunks", "--engine vllm: chunks carrying tokens "
                                            "that the engine's streams brought (generation tokens over this: tokens "
                                            "per chunk, which --engine-stream-interval raises).", registry=r)
        self.core_compiled = Gauge("sluice_scheduler_core_compiled",
                                   "1 when the scheduler core runs compiled by mypyc (make compiled), 0 from source.",
                                   registry=r)
        # prefill/decode hand-offs (docs/disaggregation.md): the decode side counts its pulls, the prefill side holds
        self.kv_transfers = Counter("sluice_kv_transfers", "KV hand-offs this replica pulled as the decode side, by "
                                    "outcome (received; empty: a prompt shorter than a block, nothing to move; failed, "
                                    "no_room, cancelled: the prompt is recomputed here or the request ends).",
                                    ["outcome"], registry=r)
        self.kv_room_waits = Counter("sluice_kv_room_waits", "Decode side: hand-offs that found no room here and waited "
                                     "for it, by outcome (room: blocks freed in time and the transfer went on; timeout: "
                                     "the prompt is recomputed here; cancelled).", ["outcome"], registry=r)
        for outcome in ("room", "timeout", "cancelled"):
            self.kv_room_waits.labels(outcome)
        self.kv_room_wait_duration = Histogram("sluice_kv_room_wait_seconds", "Decode side: how long a hand-off waited "
                                               "for room here.", buckets=ROUND_BUCKETS, registry=r)
        self.kv_transfer_blocks = Counter("sluice_kv_transfer_blocks", "KV blocks received from prefill replicas.",
                                          registry=r)
        self.kv_transfer_bytes = Counter("sluice_kv_transfer_bytes", "KV bytes received from prefill replicas.",
                                         registry=r)
        self.kv_transfer_duration = Histogram("sluice_kv_transfer_seconds", "Decode side: from the hand-off's Submit "
                                              "to the blocks registered here (HeldKv + the workers' stream).",
                                              buckets=ROUND_BUCKETS, registry=r)
        self.kv_held_blocks = Gauge("sluice_kv_held_blocks", "Prefill side: KV blocks pinned for hand-offs not yet "
                                    "received.", registry=r)
        self.kv_holds_ended = Counter("sluice_kv_holds_ended", "Prefill side: hand-off holds ended, by reason "
                                      "(received, failed, no_room, cancelled, expired).", ["reason"], registry=r)
        self._queue_length = Gauge("sluice_queue_length", "Requests waiting.", registry=r)
        self._running = Gauge("sluice_running_requests", "Requests running.", registry=r)
        self.kv_blocks_used = Gauge("sluice_kv_blocks_used", "KV blocks referenced by requests.", registry=r)
        self.kv_blocks_free = Gauge("sluice_kv_blocks_free", "KV blocks allocatable now.", registry=r)
        self.kv_blocks_cached = Gauge("sluice_kv_blocks_cached", "Free KV blocks holding cached prefixes.",
                                      registry=r)
        self._prefix_hit_tokens = Counter("sluice_prefix_hit_tokens", "Prompt tokens found in the prefix cache.",
                                          registry=r)
        self._prefix_query_tokens = Counter("sluice_prefix_query_tokens",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.host_prefix_hit_tokens = Counter("sluice_host_prefix_hit_tokens", "Prompt tokens found in the host "
                                              "(CPU) prefix tier and copied back instead of computed (part of "
                                              "sluice_prefix_hit_tokens).", registry=r)
        self.host_blocks_cached = Gauge("sluice_host_blocks_cached", "Host blocks holding prefix-tier copies of "
                                        "evicted KV blocks.", registry=r)
        self.host_blocks_used = Gauge("sluice_host_blocks_used", "Host blocks in use: swap copies of preempted "
                                      "requests, prefix-tier copies, and copies in flight (all of them free again "
                                      "when nothing runs, but the prefix tier's).", registry=r)
        self._preemptions = Counter("sluice_preemptions", "Requests preempted.", registry=r)
        self.recomputed_tokens = Counter("sluice_recomputed_tokens", "Tokens computed again after preemption.",
                                         registry=r)
        self.rejections = Counter("sluice_rejections", "Submissions rejected, by reason.", ["reason"],
                                  registry=r)
        self.cancellations = Counter("sluice_cancellations", "Requests cancelled.", registry=r)
        self.drains = Counter("sluice_replica_drains", "Drains of this replica, by how they ended: "
                              "finished (nothing left) or handed_off (the rest given to migration).", ["outcome"],
                              registry=r)
        self.drain_duration = Histogram("sluice_replica_drain_seconds", "Drain start to retirement.",
                                        buckets=REQUEST_DURATION_BUCKETS, registry=r)
        zero_series(self.rejections, (reason.value for reason in RejectReason))
        zero_series(self.drains, DRAIN_OUTCOMES)
        self.handed_off = Counter("sluice_replica_handed_off_requests",
                                  "Requests a drain past its timeout handed to migration.", registry=r)
        self.timeouts = Counter("sluice_timeouts", "Requests timed out.", registry=r)
        self.finished = Counter("sluice_requests_finished", "Requests in a terminal state, by finish reason.",
                                ["finish_reason"], registry=r)
        self.dropped_results = Counter("sluice_dropped_results", "Late or stale round results dropped.",
                                       registry=r)
        self.rounds = Counter("sluice_rounds", "Rounds executed.", registry=r)
        self.rounds_ahead = Counter("sluice_rounds_ahead", "Rounds planned and sent while the one before "
                                    "still executed (the pipelined loop).", registry=r)
        self.round_errors = Counter("sluice_round_errors", "Rounds the worker reported as failed.", registry=r)
        self.worker_link = Gauge("sluice_scheduler_worker_link", "How rounds go to the worker: 1 for the kind in use "
                                 "(round_link, grpc_stream, grpc_unary), 0 for the others.", ["kind"], registry=r)
        for kind in WORKER_LINKS:
            self.worker_link.labels(kind).set(0)
        self.round_link_frames = FrameTally("sluice_scheduler_round_link", r)
        self.attention_tokens = Counter("sluice_attention_charged_tokens", "Round-budget tokens deep prefill "
                                        "chunks paid for their attention (attention_pairs_per_token): what the "
                                        "charge took from the rounds planned.", registry=r)
        self.vllm = _VllmFamilies(r)
        self.bind_model(self.model_name)

    def kv_entry_published(self, events: int) -> None:
        """Count one KV event entry put on the kv stream, holding `events` events."""
        self._kv_entries.inc()
        self._kv_entry_events.inc(events)

    def publication_spaced(self, batches: int) -> None:
        """Count one publication that waited for the publication interval, carrying `batches` queued batches."""
        self._spaced.inc()
        self._spaced_batches.inc(batches)

    def bind_model(self, model_name: str) -> None:
        """Label the vLLM metrics with `model_name` from now on (the previous label's series are removed)."""
        v, previous = self.vllm, self.model_name
        if previous != model_name:
            v.clear()
        self.model_name = model_name
        labels = {"model_name": model_name}
        self.ttft = Fanout(self._ttft, v.ttft.labels(**labels))
        self.itl = Fanout(self._itl, v.itl.labels(**labels))
        self.request_duration = Fanout(self._request_duration, v.e2e.labels(**labels))
        self.queue_length = Fanout(self._queue_length, v.waiting.labels(**labels))
        self.running = Fanout(self._running, v.running.labels(**labels))
        self.preemptions = Fanout(self._preemptions, v.preemptions.labels(**labels))
        self.prefix_hit_tokens = Fanout(self._prefix_hit_tokens, v.prefix_hits.labels(**labels))
        self.prefix_query_tokens = Fanout(self._prefix_query_tokens, v.prefix_queries.labels(**labels))
        self.kv_usage = v.kv_usage.labels(**labels)
        self.queue_time = v.queue_time.labels(**labels)
        self.prompt_tokens = v.prompt_tokens.labels(**labels)
        self.generation_tokens = v.generation_tokens.labels(**labels)

    def request_success(self, finish_reason: str) -> None:
        """Count a terminal request under vLLM's `vllm:request_success_total{finished_reason}`."""
        reason = VLLM_FINISH_REASONS.get(finish_reason, "error")
        self.vllm.success.labels(model_name=self.model_name, finished_reason=reason).inc()


class _VllmFamilies:
    """vLLM's metric families (V1 names; see the module docstring for the source), label `model_name`."""

    def __init__(self, r: CollectorRegistry) -> None:
        m = ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting (queued or preempted).", m, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV blocks referenced by requests (0-1; 1 means 100 percent).", m,
                              registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token: enqueue at this replica to the first output token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m,
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Enqueue at this replica to the terminal state.", m, buckets=REQUEST_DURATION_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time in the WAITING phase: enqueue to first scheduled.", m,
                                    buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests whose prefill completed.",
                                     m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens generated.", m, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted.", m, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in prompt tokens looked up.", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found.", m,
                                   registry=r)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)

    def clear(self) -> None:
        """Drop every series (those of a model label that no longer applies)."""
        for family in (self.waiting, self.running, self.kv_usage, self.ttft, self.itl, self.e2e, self.queue_time,
                       self.prompt_tokens, self.generation_tokens, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.success):
            family.clear()


@dataclass
class WorkerMetrics:
    """Metrics of one worker service."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.execute_duration = Histogram("sluice_worker_execute_seconds", "Backend time of one round.",
                                          buckets=ROUND_BUCKETS, registry=r)
        self.rounds = Counter("sluice_worker_rounds", "Rounds executed, by RPC.", ["rpc"], registry=r)
        self.round_errors = Counter("sluice_worker_round_errors", "Rounds that raised in the backend.",
                                    registry=r)
        self.refused_seqs = Counter("sluice_worker_refused_sequences",
                                    "Sequences refused from a round (they do not fit the worker; the rest of "
                                    "the round ran), by field.", ["field"], registry=r)
        self.tokens = Counter("sluice_worker_tokens", "Query tokens computed, by kind.", ["kind"], registry=r)
        self.structured_tokens = Counter("sluice_worker_structured_tokens",
                                         "Tokens sampled under a structured output's grammar mask.", registry=r)
        self.serving = Gauge("sluice_worker_serving", "1 once weights are loaded and warm-up ran.", registry=r)
        self.kv_transfer_blocks = Counter("sluice_worker_kv_transfer_blocks", "KV blocks moved between workers "
                                          "(prefill/decode hand-offs), by direction (sent, received).",
                                          ["direction"], registry=r)
        self.kv_transfer_bytes = Counter("sluice_worker_kv_transfer_bytes", "KV bytes moved between workers, by "
                                         "direction (sent, received).", ["direction"], registry=r)
        self.kv_transfer_failures = Counter("sluice_worker_kv_transfer_failures", "KV pulls whose source stream "
                                            "broke or ended early.", registry=r)
        self.round_links = Gauge("sluice_worker_round_links", "Round links open (schedulers sending rounds "
                                 "over the round link instead of ExecuteStream).", registry=r)
        self.round_link_frames = FrameTally("sluice_worker_round_link", r)
        self.round_link_errors = Counter("sluice_worker_round_link_errors", "Round links refused or dropped for "
                                         "what the peer sent, by reason.", ["reason"], registry=r)
        zero_series(self.round_link_errors, ROUND_LINK_ERRORS)
        self.idle = Histogram("sluice_worker_idle_seconds",
                              "Device idle between the end of one round and the start of the next "
                              "(the control plane's gap; long ones are a replica without work).",
                              buckets=IDLE_BUCKETS, registry=r)


@dataclass
class RouterMetrics:
    """Metrics of one router service."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.routes = Counter("sluice_routes", "Requests routed, by replica.", ["replica"], registry=r)
        self.route_failures = Counter("sluice_route_failures", "Route calls with no eligible replica.",
                                      registry=r)
        self.stale_routes = Counter("sluice_router_stale_routes", "Routed requests forgotten because their replica "
                                    "reported itself idle over a heartbeat timeout after the route (their caller "
                                    "died between Route and Submit).", registry=r)
        self.dry_runs = Counter("sluice_route_dry_runs", "Route calls that only predicted (dry_run: nothing "
                                "recorded, not counted in sluice_routes).", registry=r)
        self.cached_blocks = Histogram("sluice_route_cached_blocks", "Prefix blocks found on the chosen replica.",
                                       buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.kv_events = Counter("sluice_router_kv_events", "KV events applied to the prefix index.", registry=r)
        self.kv_gaps = Counter("sluice_router_kv_gaps", "Event-id gaps that triggered a snapshot.", registry=r)
        self.predictions_retracted = Counter("sluice_router_predictions_retracted", "Routed requests refused before "
                                             "they ran (REJECTED) whose predicted prefix blocks were taken back.",
                                             registry=r)
        self.decode_routes = Counter("sluice_router_decode_routes", "Disaggregated routes whose decodes go to another "
                                     "replica than the prompt (a KV transfer), by decode replica.", ["replica"],
                                     registry=r)
        self.snapshots = Counter("sluice_router_snapshots", "KV snapshots fetched, by outcome.", ["outcome"],
                                 registry=r)
        self.replicas = Gauge("sluice_router_replicas", "Replicas known, by state.", ["state"], registry=r)
        self.unreachable_reports = Counter("sluice_router_unreachable_reports",
                                           "ReportUnreachable calls, by outcome (confirmed: probe failed, replica "
                                           "UNHEALTHY; refuted: it answered; unknown: not that replica).",
                                           ["outcome"], registry=r)
        zero_series(self.unreachable_reports, UNREACHABLE_OUTCOMES)


@dataclass
class AdmissionMetrics:
    """Metrics of one admission process (the front door)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("sluice_admission_requests", "Generate calls, by tenant and outcome.",
                                ["tenant", "outcome"], registry=r)
        self.rejections = Counter("sluice_admission_rejections", "Refused requests, by reason.", ["reason"],
                                  registry=r)
        self.active = Gauge("sluice_admission_active_requests", "Admitted, not terminal.", registry=r)
        self.tokenize = Histogram("sluice_admission_tokenize_seconds",
                                  "Tokenizing one prompt, waiting for a tokenizer thread included.",
                                  buckets=TOKENIZE_BUCKETS, registry=r)
        self.ttft = Histogram("sluice_admission_time_to_first_token_seconds", "Received to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("sluice_admission_time_per_output_token_seconds", "Per token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("sluice_admission_request_duration_seconds", "Received to terminal.",
                                  buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.cancellations = Counter("sluice_admission_cancellations", "Cancels sent, by cause.", ["cause"],
                                     registry=r)
        self.missing_tokens = Counter("sluice_admission_missing_tokens",
                                      "Tokens a completion counted that never arrived.", registry=r)
        self.reserved_output_tokens = Gauge("sluice_admission_reserved_output_tokens",
                                            "Output tokens reserved by admitted requests (ledger 1).", registry=r)
        self.reserved_kv_blocks = Gauge("sluice_admission_reserved_kv_blocks",
                                        "KV blocks reserved at admission, shared prompt blocks once (ledger 1).",
                                        registry=r)
        self.reservation_growths = Counter("sluice_admission_reservation_growths",
                                           "Reservations grown because the request outran them, by outcome "
                                           "(granted, overcommitted: no budget left, granted anyway).",
                                           ["outcome"], registry=r)
        self.reclaimed_output_tokens = Counter("sluice_admission_reclaimed_output_tokens",
                                               "Reserved output tokens finished requests did not use.", registry=r)
        self.predicted_ttft = Histogram("sluice_admission_predicted_ttft_seconds",
                                        "The router's predicted time to first token of each routed request.",
                                        buckets=TTFT_BUCKETS, registry=r)
        self.migrations = Counter("sluice_admission_migrations",
                                  "Requests moved to another replica, by cause (admission_svc/migration.py).",
                                  ["cause"], registry=r)
        self.reroutes = Counter("sluice_admission_reroutes",
                                "Submits that could not reach the routed scheduler and were routed again, by the "
                                "failed call's status code (admission_svc/migration.py).", ["code"], registry=r)
        self.handoffs = Counter("sluice_admission_kv_handoffs", "Prefill/decode hand-offs: a prefill half that "
                                "finished and its decode half submitted to the pair's decode replica (submitted), or "
                                "that decode Submit refused (failed: the request is placed again and recomputed).",
                                ["outcome"], registry=r)
        zero_series(self.handoffs, ("submitted", "failed"))
        self.completions_fetched = Counter("sluice_admission_completions_fetched",
                                           "Completions a Lookup fetched from their scheduler, by what their bus copy "
                                           "showed (late: it came after; lost: none within the grace; unresolved: "
                                           "forgotten unjudged) (admission_svc/lookups.py).", ["outcome"], registry=r)
        self.migration_failures = Counter("sluice_admission_migration_failures",
                                          "Requests ended FAILED instead of moving, by reason.", ["reason"],
                                          registry=r)
        zero_series(self.migration_failures, MIGRATION_FAILURE_REASONS)
        self.http_stream_events = Counter("sluice_admission_http_stream_events",
                                          "Chunks of streamed OpenAI HTTP responses (text and finish), by way: written "
                                          "by the token reader the moment their tokens arrived (at_once), or by the "
                                          "request's own task (admission_svc/http_edge.py).", ["way"], registry=r)
        zero_series(self.http_stream_events, ("at_once", "task"))
        self.budget_in_use = Gauge("sluice_admission_budget_in_use",
                                   "Admission ledger now: active, queued, pending_input_tokens, reserved_output_tokens.",
                                   ["budget"], registry=r)
        self.gen_ai = _GenAiFamilies(r)

    def gen_ai_request(self, operation: str, model: str, outcome: RequestOutcome) -> None:
        """Record one ended request in the GenAI families (TTFT and TPOT only for successful ones)."""
        g, labels = self.gen_ai, {"gen_ai_operation_name": operation, "gen_ai_request_model": model}
        g.duration.labels(**labels, error_type=outcome.error_type).observe(outcome.duration_s)
        if not outcome.error_type and outcome.ttft_s is not None:
            g.ttft.labels(**labels).observe(outcome.ttft_s)
            if outcome.tpot_s is not None:
                g.tpot.labels(**labels).observe(outcome.tpot_s)
        g.token_usage.labels(**labels, gen_ai_token_type="input").observe(outcome.input_tokens)
        g.token_usage.labels(**labels, gen_ai_token_type="output").observe(outcome.output_tokens)


@dataclass(frozen=True)
class RequestOutcome:
    """What the GenAI metrics record of one ended request."""

    duration_s: float
    """Received to terminal."""
    ttft_s: float | None
    """Received to first token (None: no token)."""
    tpot_s: float | None
    """Mean time per output token after the first (None: fewer than two tokens)."""
    input_tokens: int
    output_tokens: int
    error_type: str = ""
    """The terminal status name when the request did not finish; "" when it did (the label is then absent)."""


class _GenAiFamilies:
    """The OpenTelemetry GenAI model-server metrics (and client token usage) as Prometheus names."""

    def __init__(self, r: CollectorRegistry) -> None:
        op = ["gen_ai_operation_name", "gen_ai_request_model"]
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                              "gen_ai.server.time_to_first_token: received to first token, successful requests.",
                              op, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                              "gen_ai.server.time_per_output_token: per output token after the first, successful "
                              "requests.", op, buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("gen_ai_server_request_duration_seconds",
                                  "gen_ai.server.request.duration: received to last output token or end.",
                                  [*op, "error_type"], buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.token_usage = Histogram("gen_ai_client_token_usage",
                                     "gen_ai.client.token.usage: input and output tokens per request, as billed.",
                                     [*op, "gen_ai_token_type"], buckets=TOKEN_USAGE_BUCKETS, registry=r)
