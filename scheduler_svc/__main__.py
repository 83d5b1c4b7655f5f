"""`python -m scheduler_svc`: run one replica's scheduler in front of its worker, as a gRPC service."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.core.config import Policy, PreemptionMode
from scheduler_svc.server import start_replica
from sluice import serve
from sluice.prom import SchedulerMetrics


@dataclass(frozen=True, kw_only=True)
class SchedulerOptions(serve.BusOptions):
    """The scheduler's flags."""

    replica_id: str
    """The replica's id at the router."""
    worker: str
    """Worker HOST:PORT."""
    advertise_host: str = "127.0.0.1"
    """Host the router gives to admission for this scheduler."""
    router: str = ""
    """Router HOST:PORT; empty: do not register."""
    policy: str = "fcfs"
    """Queue policy (Policy value)."""
    preemption: str = "recompute"
    """Preemption mode (PreemptionMode value)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one round."""
    max_num_seqs: int = 256
    """Sequences in one round at most."""
    max_prefill_chunk: int = 512
    """Prompt tokens of one sequence in one round at most."""
    max_kv_read_tokens: int | None = None
    """KV tokens one round may read at most; None: no limit."""
    max_waiting: int = 4096
    """Waiting requests at most; more are refused."""
    no_prefix_caching: bool = False
    """Turn prefix caching off."""
    prefill_tokens_per_s: float = 10_000.0
    """Told to the router for its TTFT prediction."""
    decode_round_s: float = 0.01
    """Told to the router for its TTFT prediction."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats to the router."""
    drain_timeout: float = 30.0
    """Seconds to finish work on SIGTERM."""
    unary: bool = False
    """One Execute call per round instead of ExecuteStream."""
    publish_first_max_tokens: int = 64
    """Rounds with at most this many tokens publish before the next round starts; larger ones
    publish while it runs (overlap pays once conversion costs more than the wait it adds)."""


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of the scheduler."""
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    serve.add_common_flags(p, default_port=50071)
    serve.add_redis_flags(p)
    p.add_argument("--advertise-host", default="127.0.0.1", help="host the router gives to admission")
    p.add_argument("--replica-id", required=True, help="this replica's id at the router")
    p.add_argument("--worker", required=True, help="worker HOST:PORT")
    p.add_argument("--router", default="", help="router HOST:PORT (default: do not register)")
    p.add_argument("--policy", default="fcfs", choices=[x.value for x in Policy])
    p.add_argument("--preemption", default="recompute", choices=[x.value for x in PreemptionMode])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one round")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one round at most")
    p.add_argument("--max-prefill-chunk", type=int, default=512, help="prompt tokens of one sequence per round")
    p.add_argument("--max-kv-read-tokens", type=int, default=None, help="KV tokens one round may read")
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting requests at most")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                   help="told to the router for its TTFT prediction")
    p.add_argument("--decode-round-s", type=float, default=0.01, help="told to the router")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    p.add_argument("--unary", action="store_true", help="one Execute call per round instead of ExecuteStream")
    p.add_argument("--publish-first-max-tokens", type=int, default=64,
                   help="rounds with more tokens than this publish while the next round runs (default 64)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> SchedulerOptions:
    """Return the scheduler's options (argparse exits with a usage message on bad flags)."""
    return serve.load_options(SchedulerOptions, build_parser(), argv)


def core_overrides(options: SchedulerOptions) -> dict[str, object]:
    """Return the SchedulerConfig fields the flags set (the rest come from the worker's Info)."""
    return {
        "policy": Policy(options.policy), "preemption_mode": PreemptionMode(options.preemption),
        "max_num_batched_tokens": options.max_num_batched_tokens, "max_num_seqs": options.max_num_seqs,
        "max_prefill_chunk": options.max_prefill_chunk, "max_kv_read_tokens": options.max_kv_read_tokens,
        "max_waiting": options.max_waiting, "enable_prefix_caching": not options.no_prefix_caching,
    }


async def start(ctx: serve.ServiceContext, options: SchedulerOptions) -> serve.Started:
    """Wait for the worker, then serve and register; returns how to drain (finish work, then cancel the rest)."""
    metrics = SchedulerMetrics()
    ctx.expose_metrics(metrics.registry)
    bus = await serve.open_bus(ctx, options)
    try:
        replica = await start_replica(
            replica_id=options.replica_id, worker_address=options.worker, bus=bus, router_address=options.router,
            port=options.port, host=options.host, advertise_host=options.advertise_host,
            core_overrides=core_overrides(options), metrics=metrics, heartbeat_interval_s=options.heartbeat_interval,
            prefill_tokens_per_s=options.prefill_tokens_per_s, decode_round_s=options.decode_round_s,
            use_stream=not options.unary, publish_first_max_tokens=options.publish_first_max_tokens)
    except (TimeoutError, ValueError) as exc:
        raise serve.StartupError(str(exc)) from exc

    async def drain() -> None:
        await replica.stop(options.drain_timeout)

    return serve.Started(replica.port, drain=drain, watched=replica.tasks, label=f"scheduler {options.replica_id}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a configuration error, 1 when a task fails)."""
    options = parse_args(argv)
    return serve.run_service("scheduler", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
