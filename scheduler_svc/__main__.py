"""`python -m scheduler_svc`: run one replica's scheduler in front of its worker, as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import redis.asyncio as aioredis

from scheduler_svc.core.config import Policy, PreemptionMode
from scheduler_svc.server import start_replica
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics, serve_metrics
from sluice.telemetry import setup_tracing

log = logging.getLogger("scheduler_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the parsed command line (argparse exits with a usage message on bad flags)."""
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--advertise-host", default="127.0.0.1", help="host the router gives to admission")
    p.add_argument("--port", type=int, default=50071, help="gRPC port (0 picks a free one)")
    p.add_argument("--replica-id", required=True)
    p.add_argument("--worker", required=True, help="worker HOST:PORT")
    p.add_argument("--router", default="", help="router HOST:PORT (default: do not register)")
    p.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL", ""),
                   help="Redis URL (default: $SLUICE_REDIS_URL)")
    p.add_argument("--namespace", default="default", help="bus namespace (keys sluice:{namespace}:...)")
    p.add_argument("--policy", default="fcfs", choices=[x.value for x in Policy])
    p.add_argument("--preemption", default="recompute", choices=[x.value for x in PreemptionMode])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-prefill-chunk", type=int, default=512)
    p.add_argument("--max-kv-read-tokens", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=4096)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                   help="told to the router for its TTFT prediction")
    p.add_argument("--decode-round-s", type=float, default=0.01, help="told to the router")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    p.add_argument("--unary", action="store_true", help="one Execute call per round instead of ExecuteStream")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def core_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Return the SchedulerConfig fields the flags set (the rest come from the worker's Info)."""
    return {
        "policy": Policy(args.policy), "preemption_mode": PreemptionMode(args.preemption),
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "max_prefill_chunk": args.max_prefill_chunk, "max_kv_read_tokens": args.max_kv_read_tokens,
        "max_waiting": args.max_waiting, "enable_prefix_caching": not args.no_prefix_caching,
    }


async def amain(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then drain; return the exit code (2 on a configuration error)."""
    if not args.redis_url:
        log.error("no Redis: pass --redis-url or set SLUICE_REDIS_URL")
        return 2
    setup_tracing("sluice-scheduler")
    metrics = SchedulerMetrics()
    if args.metrics_port is not None:
        serve_metrics(metrics.registry, args.metrics_port)
    client = aioredis.Redis.from_url(args.redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        replica = await start_replica(
            replica_id=args.replica_id, worker_address=args.worker, bus=Bus(client, args.namespace),
            router_address=args.router, port=args.port, host=args.host, advertise_host=args.advertise_host,
            core_overrides=core_overrides(args), metrics=metrics, heartbeat_interval_s=args.heartbeat_interval,
            prefill_tokens_per_s=args.prefill_tokens_per_s, decode_round_s=args.decode_round_s,
            use_stream=not args.unary)
    except (TimeoutError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        await client.aclose()
        return 2
    print(f"scheduler {args.replica_id} listening on {args.host}:{replica.port}", flush=True)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([stopping, *replica.tasks], return_when=asyncio.FIRST_COMPLETED)
    crashed = [t for t in replica.tasks if t.done() and t.exception() is not None]
    if crashed:
        # The loop or the agent died of a bug: serving Submits that never run would hide it.
        log.error("scheduler task failed; exiting", exc_info=crashed[0].exception())
        await client.aclose()
        return 1
    log.info("draining")
    await replica.stop(args.drain_timeout)
    stopping.cancel()
    await client.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
