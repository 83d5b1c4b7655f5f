"""Prometheus metrics: one registry per service, served by `serve_metrics(registry, port)`.

Latency histograms use the bucket boundaries the OpenTelemetry GenAI semantic conventions advise for
`gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token` and
`gen_ai.server.request.duration`, so dashboards built for either agree.
Metric names are listed in docs/operations.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "REQUEST_DURATION_BUCKETS", "TPOT_BUCKETS", "TTFT_BUCKETS", "AdmissionMetrics", "RouterMetrics",
    "SchedulerMetrics", "WorkerMetrics", "serve_metrics",
]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                            40.96, 81.92)
# Tokenizing one prompt: microseconds for a chat turn, about a second for a 1 MiB prompt.
TOKENIZE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Rounds of a CPU engine or a modelled GPU: from sub-millisecond to seconds.
ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> int:
    """Serve `registry` at http://addr:port/metrics in a daemon thread; return the bound port (port 0 picks one).

    Raises OSError when the port is taken.
    """
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return int(server.server_port)


@dataclass
class SchedulerMetrics:
    """Metrics of one replica's scheduler service."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Enqueue to first output token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("sluice_time_per_output_token_seconds",
                              "Mean time per output token after the first, per finished request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("sluice_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=TPOT_BUCKETS, registry=r)
        self.request_duration = Histogram("sluice_request_duration_seconds", "Enqueue to terminal state.",
                                          buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self.round_duration = Histogram("sluice_round_duration_seconds",
                                        "Wall time of one scheduling round (plan, execute, result).",
                                        buckets=ROUND_BUCKETS, registry=r)
        self.queue_length = Gauge("sluice_queue_length", "Requests waiting.", registry=r)
        self.running = Gauge("sluice_running_requests", "Requests running.", registry=r)
        self.kv_blocks_used = Gauge("sluice_kv_blocks_used", "KV blocks referenced by requests.", registry=r)
        self.kv_blocks_free = Gauge("sluice_kv_blocks_free", "KV blocks allocatable now.", registry=r)
        self.kv_blocks_cached = Gauge("sluice_kv_blocks_cached", "Free KV blocks holding cached prefixes.",
                                      registry=r)
        self.prefix_hit_tokens = Counter("sluice_prefix_hit_tokens", "Prompt tokens found in the prefix cache.",
                                         registry=r)
        self.prefix_query_tokens = Counter("sluice_prefix_query_tokens",
                                           "Prompt tokens looked up in the prefix cache.", registry=r)
        self.preemptions = Counter("sluice_preemptions", "Requests preempted.", registry=r)
        self.recomputed_tokens = Counter("sluice_recomputed_tokens", "Tokens computed again after preemption.",
                                         registry=r)
        self.rejections = Counter("sluice_rejections", "Submissions rejected, by reason.", ["reason"],
                                  registry=r)
        self.cancellations = Counter("sluice_cancellations", "Requests cancelled.", registry=r)
        self.timeouts = Counter("sluice_timeouts", "Requests timed out.", registry=r)
        self.finished = Counter("sluice_requests_finished", "Requests in a terminal state, by finish reason.",
                                ["finish_reason"], registry=r)
        self.dropped_results = Counter("sluice_dropped_results", "Late or stale round results dropped.",
                                       registry=r)
        self.rounds = Counter("sluice_rounds", "Rounds executed.", registry=r)
        self.round_errors = Counter("sluice_round_errors", "Rounds the worker reported as failed.", registry=r)


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
        self.tokens = Counter("sluice_worker_tokens", "Query tokens computed, by kind.", ["kind"], registry=r)
        self.serving = Gauge("sluice_worker_serving", "1 once weights are loaded and warm-up ran.", registry=r)


@dataclass
class RouterMetrics:
    """Metrics of one router service."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.routes = Counter("sluice_routes", "Requests routed, by replica.", ["replica"], registry=r)
        self.route_failures = Counter("sluice_route_failures", "Route calls with no eligible replica.",
                                      registry=r)
        self.cached_blocks = Histogram("sluice_route_cached_blocks", "Prefix blocks found on the chosen replica.",
                                       buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.kv_events = Counter("sluice_router_kv_events", "KV events applied to the prefix index.", registry=r)
        self.kv_gaps = Counter("sluice_router_kv_gaps", "Event-id gaps that triggered a snapshot.", registry=r)
        self.snapshots = Counter("sluice_router_snapshots", "KV snapshots fetched, by outcome.", ["outcome"],
                                 registry=r)
        self.replicas = Gauge("sluice_router_replicas", "Replicas known, by state.", ["state"], registry=r)


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
