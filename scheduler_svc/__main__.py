"""`python -m scheduler_svc`: run one replica's scheduler in front of its worker, as a gRPC service.

With `--engine vllm` the replica is an unmodified vLLM server instead (scheduler_svc/engines/vllm): the same
gRPC contract, registration and Redis publications, with a gateway queue in front of vLLM's own scheduler."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from scheduler_svc.core import COMPILED as core_compiled
from scheduler_svc.core.config import Policy, PreemptionMode, SchedulerConfig, VictimPolicy
from scheduler_svc.server import DEFAULT_MAX_MODEL_LEN, SERVICE_NAME, RunningReplica, start_replica
from sluice import serve
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics
from sluice.round_budget import derive_round_budget, linear_round_time
from sluice.types import ReplicaRole
from sluice.v1 import worker_pb2

log = logging.getLogger(__name__)

_CORE = SchedulerConfig(num_blocks=1)
"""The core's defaults, which the flags share (num_blocks comes from the worker)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerOptions(serve.BusOptions):
    """The scheduler's flags; the core's settings default to SchedulerConfig's (written there once)."""

    port: int = 50071
    """gRPC port; 0 picks a free one."""
    replica_id: str
    """This replica's id at the router."""
    worker: str = ""
    """Worker HOST:PORT (--engine sluice)."""
    kv_worker_address: str = ""
    """The worker's HOST:PORT as other replicas' workers reach it to pull KV blocks (a hand-off's HeldKv answers it;
    in Kubernetes the pod's IP, where --worker is 127.0.0.1 in the pod); empty: --worker."""
    engine: str = "sluice"
    """What executes the requests: sluice (the worker at --worker) or vllm (the server at --engine-url)."""
    engine_url: str = ""
    """--engine vllm: the vLLM OpenAI server, http://HOST:PORT."""
    engine_kv_events: str = ""
    """--engine vllm: its KV-event PUB endpoint (kv_events_config endpoint, e.g. ipc:///run/kv.sock); empty: the
    router gets no KV events from this replica (no prefix-aware routing)."""
    engine_kv_replay: str = ""
    """--engine vllm: its KV-event replay endpoint (kv_events_config replay_endpoint)."""
    engine_model_id: str = ""
    """--engine vllm: the model id admission and the router use; empty: the engine's served model name."""
    max_inflight: int = 16
    """--engine vllm: requests on the engine at once at most; the rest wait in this replica's policy-ordered queue."""
    engine_priority: bool = False
    """--engine vllm: pass each request's priority to vLLM (start it with --scheduling-policy priority)."""
    engine_startup_timeout: float = 600.0
    """--engine vllm: seconds to wait for the engine to answer at start."""
    engine_stream_interval: int = 1
    """--engine vllm: tokens per chunk asked of vLLM for each request (its per-request stream_interval; the first
    token and the end come at once): above 1, fewer chunks cost this agent and vLLM's API server less CPU per token,
    and a token reaches the client up to N-1 decode rounds later."""
    advertise_host: str = "127.0.0.1"
    """Host the router gives to admission for this scheduler."""
    router: str = ""
    """Router HOST:PORT; empty: do not register."""
    policy: Policy = _CORE.policy
    """Order of the waiting queue."""
    preemption: PreemptionMode = _CORE.preemption_mode
    """What happens to a victim's KV when blocks run out."""
    victim_policy: VictimPolicy = _CORE.victim_policy
    """Which running request is preempted when KV blocks run out."""
    max_num_batched_tokens: int = _CORE.max_num_batched_tokens
    """Token budget of one round (prefill chunk tokens + one per decode)."""
    max_num_seqs: int = _CORE.max_num_seqs
    """Sequences in one round at most."""
    max_prefill_chunk: int = _CORE.max_prefill_chunk
    """Prompt tokens of one sequence in one round at most (chunked prefill)."""
    max_kv_read_tokens: int | None = _CORE.max_kv_read_tokens
    """KV tokens one round may read at most (bounds inter-token latency); None: no limit."""
    attention_pairs_per_token: int | None = _CORE.attention_pairs_per_token
    """A prefill chunk pays one token of the round's budget per this many (token, earlier token) pairs of its
    attention beyond --attention-free-context (a deep chunk of a long prompt shrinks to fit the round); None: not
    charged."""
    attention_free_context: int = _CORE.attention_free_context
    """Context before a chunk whose attention is not charged (--attention-pairs-per-token)."""
    tpot_slo_ms: float = 0.0
    """Above 0: derive the round's token budget from this TPOT target and the registered rates
    (--prefill-tokens-per-s, --decode-round-s; sluice.round_budget.linear_round_time) at start,
    instead of --max-num-batched-tokens; with --prefill-pair-s above 0 also the attention charge, instead of
    --attention-pairs-per-token; with --kv-read-s-per-token above 0 also the seat cap and the KV-read budget."""
    max_waiting: int = _CORE.max_waiting
    """Waiting requests at most; more are refused with QUEUE_FULL."""
    no_prefix_caching: bool = not _CORE.enable_prefix_caching
    """Turn prefix caching off."""
    host_prefix_cache: bool = _CORE.host_prefix_cache
    """Keep copies of the KV blocks the device will evict next in the worker's host blocks (its --host-blocks) and
    copy them back for a prompt that continues there, instead of computing them again (docs/operations.md)."""
    host_page_out_blocks: int = _CORE.host_page_out_blocks
    """--host-prefix-cache: how many of the device's least recently used cached blocks are kept copied to host."""
    host_load_blocks: int = _CORE.host_load_blocks
    """--host-prefix-cache: blocks one round copies back at most (0: no limit)."""
    kv_event_token_ids: bool = _CORE.kv_event_token_ids
    """Send each stored block's token ids in its KV event (vLLM's BlockStored.token_ids; bigger events)."""
    prefill_tokens_per_s: float = 10_000.0
    """Prefill speed told to the router for its TTFT prediction."""
    decode_round_s: float = 0.01
    """Seconds of one decode round, told to the router for its TTFT prediction."""
    prefill_pair_s: float = 0.0
    """Attention seconds per (token, earlier token) pair of a prompt, told to the router for its TTFT prediction of
    long prompts (router_svc.scoring.predict_ttft); 0 leaves that term out."""
    kv_read_s_per_token: float = 0.0
    """Seconds a round spends per KV token its decodes read (an H200 reads Llama-3-8B's 128 KiB per token in ~27 ns).
    Above 0 with --tpot-slo-ms: the seat cap and the KV-read budget are derived too (decodes at
    --seat-context tokens each), instead of --max-num-seqs and --max-kv-read-tokens; 0: they stay as given."""
    seat_context: int = 2048
    """Context, in tokens, of each decode the derived seat cap is sized for (--kv-read-s-per-token)."""
    role: ReplicaRole = ReplicaRole.BOTH
    """What this replica serves: both (whole requests), prefill (prompts; their KV goes to a decode replica) or
    decode (docs/disaggregation.md)."""
    kv_hold: float = 30.0
    """Prefill side: seconds a finished prompt's KV blocks stay pinned for a decode replica that never releases
    them."""
    kv_room_wait: float = 5.0
    """Decode side: seconds a hand-off waits for room here when the KV pool is full (bounded by the hold's expiry and
    the Submit's deadline) before the prompt is recomputed here instead; 0: recompute at once."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats to the router."""
    drain_timeout: float = 30.0
    """Seconds to finish work on SIGTERM."""
    unary: bool = False
    """One Execute call per round instead of ExecuteStream."""
    round_link: bool = True
    """Send rounds over the worker's round link when its Info offers one (protobuf frames on a plain stream, cheaper
    per round than gRPC); --no-round-link: over ExecuteStream."""
    no_pipeline: bool = False
    """Run rounds serially (plan, execute, apply) instead of planning round N+1 while round N executes."""
    kv_linger_ms: float = 0.0
    """Milliseconds a batch of KV events may wait for later rounds' events to go out with them as one `kv` entry (a
    completion, a drain or stopping sends them at once): at most one entry per linger per replica, whatever its round
    rate; 0: each round's events go out with that round's publication."""
    publish_interval_ms: float = 0.0
    """Milliseconds a round's tokens queued sooner than this after the replica's last publication (rounds come
    faster) wait for later rounds' to go out with them as one entry, each request's tokens as one delta (fewer
    entries, deltas and chunks for Redis, admission and the client; a token reaches admission at most this much
    later). A request's first tokens (its first 4 rounds'), a completion and a drain go out at once; 0: every round
    publishes as soon as it can. A stop string, which admission finds, ends its request up to this much later (more
    tokens computed for nothing)."""
    publish_first_max_tokens: int = 64
    """Serial loop: rounds with at most this many tokens publish before the next round starts; larger ones
    publish while it runs (overlap pays once conversion costs more than the wait it adds). The pipelined
    loop queues every round's tokens at once (the next round is already on the worker)."""


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of the scheduler (one flag per SchedulerOptions field)."""
    return serve.options_parser(SchedulerOptions, prog="python -m scheduler_svc", description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> SchedulerOptions:
    """Return the scheduler's options (argparse exits with a usage message on bad flags)."""
    return serve.load_options(SchedulerOptions, build_parser(), argv)


def core_overrides(options: SchedulerOptions, max_context: int = 1 << 17) -> dict[str, object]:
    """Return the SchedulerConfig fields the flags set (the rest come from the worker's Info).

    With --tpot-slo-ms the token budget is derived from the target and the rates the replica registers
    with (the router predicts with the same ones), the seat cap and the KV-read budget too when
    --kv-read-s-per-token is set, and the attention charge too when --prefill-pair-s is set,
    sized for a chunk starting `max_context` deep (the worker's max_model_len: a shorter model gets a lighter
    charge); raises ValueError when the target cannot be met.
    """
    tokens = options.max_num_batched_tokens
    per_token, free_context = options.attention_pairs_per_token, options.attention_free_context
    seats, kv_read = options.max_num_seqs, options.max_kv_read_tokens
    if options.seat_context <= 0:
        raise ValueError(f"--seat-context must be a positive number of tokens, got {options.seat_context}")
    for flag, value in (("--host-page-out-blocks", options.host_page_out_blocks),
                        ("--host-load-blocks", options.host_load_blocks)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if not 0 <= options.kv_read_s_per_token < math.inf:  # NaN fails too
        raise ValueError(f"--kv-read-s-per-token {options.kv_read_s_per_token}: the seconds per KV token read "
                         f"(kv_read_s) must be a finite number >= 0")
    if options.tpot_slo_ms > 0:
        model = linear_round_time(options.prefill_tokens_per_s, options.decode_round_s, options.prefill_pair_s,
                                  options.kv_read_s_per_token)
        budget = derive_round_budget(options.tpot_slo_ms / 1000.0, model, max_num_seqs=options.max_num_seqs,
                                     context_tokens=0, max_context=max_context, seat_context=options.seat_context,
                                     min_kv_read=max_context)
        tokens = budget.max_num_batched_tokens
        if budget.attention_pairs_per_token is not None:
            per_token, free_context = budget.attention_pairs_per_token, budget.attention_free_context
        if budget.max_num_seqs is not None:  # the model has a KV term (--kv-read-s-per-token)
            seats, kv_read = budget.max_num_seqs, budget.max_kv_read_tokens
    return {
        "policy": options.policy, "preemption_mode": options.preemption, "victim_policy": options.victim_policy,
        "max_num_batched_tokens": tokens, "max_num_seqs": seats,
        "max_prefill_chunk": options.max_prefill_chunk, "max_kv_read_tokens": kv_read,
        "attention_pairs_per_token": per_token, "attention_free_context": free_context,
        "max_waiting": options.max_waiting, "enable_prefix_caching": not options.no_prefix_caching,
        "host_prefix_cache": options.host_prefix_cache, "host_page_out_blocks": options.host_page_out_blocks,
        "host_load_blocks": options.host_load_blocks,
        "kv_event_token_ids": options.kv_event_token_ids, "kv_hold_s": options.kv_hold,
    }


def worker_sized_overrides(options: SchedulerOptions) -> Callable[[worker_pb2.WorkerInfo], dict[str, object]]:
    """Return `core_overrides` as a function of the worker's Info, with the charge sized for its max_model_len."""
    return lambda info: core_overrides(options, info.max_model_len or DEFAULT_MAX_MODEL_LEN)


def kv_linger_seconds(options: SchedulerOptions) -> float:
    """--kv-linger-ms in seconds; raises StartupError naming the flag unless it is a finite number >= 0."""
    if not 0 <= options.kv_linger_ms < math.inf:
        raise serve.StartupError(f"--kv-linger-ms {options.kv_linger_ms}: must be a finite number >= 0")
    return options.kv_linger_ms / 1000.0


def publish_interval_seconds(options: SchedulerOptions) -> float:
    """--publish-interval-ms in seconds; raises StartupError naming the flag unless it is a finite number >= 0."""
    if not 0 <= options.publish_interval_ms < math.inf:
        raise serve.StartupError(f"--publish-interval-ms {options.publish_interval_ms}: must be a finite number >= 0")
    return options.publish_interval_ms / 1000.0


def engine_stream_interval(options: SchedulerOptions) -> int:
    """--engine-stream-interval; raises StartupError naming the flag unless it is at least 1."""
    if options.engine_stream_interval < 1:
        raise serve.StartupError(f"--engine-stream-interval {options.engine_stream_interval}: must be at least 1 "
                                 "(tokens per chunk)")
    return options.engine_stream_interval


async def start(ctx: serve.ServiceContext, options: SchedulerOptions) -> serve.Started:
    """Wait for the worker (or engine), then serve and register; returns how to drain (finish work, then cancel
    the rest)."""
    if options.engine not in ("sluice", "vllm"):
        raise serve.StartupError(f"--engine {options.engine!r}: known engines are sluice and vllm")
    if options.engine == "sluice" and not options.worker:
        raise serve.StartupError("--worker HOST:PORT is required with --engine sluice")
    if options.engine == "vllm" and not options.engine_url:
        raise serve.StartupError("--engine-url http://HOST:PORT is required with --engine vllm")
    engine_stream_interval(options)
    kv_linger_s = kv_linger_seconds(options)
    interval_s = publish_interval_seconds(options)
    try:  # the round flags, checked before waiting for a worker (its Info only sizes the attention charge)
        core_overrides(options)
    except ValueError as exc:
        raise serve.StartupError(str(exc)) from exc
    if options.kv_read_s_per_token > 0 and options.tpot_slo_ms <= 0:
        log.warning("--kv-read-s-per-token is used only with --tpot-slo-ms: the seat cap stays --max-num-seqs %d",
                    options.max_num_seqs)
    metrics = SchedulerMetrics()
    metrics.core_compiled.set(1 if core_compiled else 0)
    log.info("scheduler core: %s", "compiled (mypyc)" if core_compiled else "pure Python")
    ctx.expose_metrics(metrics.registry)
    bus = await serve.open_bus(ctx, options)
    try:
        replica = await (_start_vllm(options, bus, metrics, ctx, kv_linger_s, interval_s) if options.engine == "vllm" else start_replica(
            replica_id=options.replica_id, worker_address=options.worker, bus=bus, router_address=options.router,
            kv_worker_address=options.kv_worker_address, kv_room_wait_s=options.kv_room_wait,
            port=options.port, host=options.host, advertise_host=options.advertise_host,
            core_overrides=worker_sized_overrides(options), metrics=metrics, heartbeat_interval_s=options.heartbeat_interval,
            prefill_tokens_per_s=options.prefill_tokens_per_s, decode_round_s=options.decode_round_s,
            prefill_pair_s=options.prefill_pair_s, use_stream=not options.unary,
            publish_first_max_tokens=options.publish_first_max_tokens,
            tls_files=serve.tls_files(options, "scheduler"), bus_alive=_bus_alive(ctx),
            drain_timeout_s=options.drain_timeout, pipeline=not options.no_pipeline, role=options.role,
            round_link=options.round_link, kv_linger_s=kv_linger_s, publish_interval_s=interval_s))
    except (TimeoutError, ValueError) as exc:
        raise serve.StartupError(str(exc)) from exc

    async def drain() -> None:
        await replica.stop(options.drain_timeout)

    return serve.Started(replica.port, drain=drain, watched=replica.tasks, label=f"scheduler {options.replica_id}",
                         health=replica.health, health_names=("", SERVICE_NAME))


def _start_vllm(options: SchedulerOptions, bus: Bus, metrics: SchedulerMetrics,
                ctx: serve.ServiceContext, kv_linger_s: float, interval_s: float) -> Awaitable[RunningReplica]:
    from scheduler_svc.engines.vllm.replica import (  # only this engine needs zmq
        EngineSettings,
        start_vllm_replica,
    )

    engine = EngineSettings(url=options.engine_url, kv_events=options.engine_kv_events,
                            kv_replay=options.engine_kv_replay, model_id=options.engine_model_id,
                            policy=options.policy, max_inflight=options.max_inflight, max_waiting=options.max_waiting,
                            priority_passthrough=options.engine_priority,
                            startup_timeout_s=options.engine_startup_timeout,
                            stream_interval=engine_stream_interval(options))
    return start_vllm_replica(
        replica_id=options.replica_id, engine=engine, bus=bus, router_address=options.router, port=options.port,
        host=options.host, advertise_host=options.advertise_host, metrics=metrics,
        heartbeat_interval_s=options.heartbeat_interval, prefill_tokens_per_s=options.prefill_tokens_per_s,
        decode_round_s=options.decode_round_s, tls_files=serve.tls_files(options, "scheduler"),
        bus_alive=_bus_alive(ctx), drain_timeout_s=options.drain_timeout, kv_linger_s=kv_linger_s,
        publish_interval_s=interval_s)


def _bus_alive(ctx: serve.ServiceContext) -> Callable[[], bool]:
    """Whether Redis answers, as the context's bus liveness probe last saw it."""
    return lambda: ctx.bus_watch is None or ctx.bus_watch.alive


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a configuration error, 1 when a task fails)."""
    options = parse_args(argv)
    return serve.run_service("scheduler", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
