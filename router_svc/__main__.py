"""`python -m router_svc`: run the router (replica registry, prefix index, scoring) as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import redis.asyncio as aioredis

from router_svc.core import RouterConfig, RouterCore, RoutingPolicy
from router_svc.server import RouterRuntime, start_router_server
from sluice.bus import Bus
from sluice.prom import RouterMetrics, serve_metrics
from sluice.telemetry import setup_tracing

log = logging.getLogger("router_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the parsed command line (argparse exits with a usage message on bad flags)."""
    p = argparse.ArgumentParser(prog="python -m router_svc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50052, help="gRPC port (0 picks a free one)")
    p.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL", ""),
                   help="Redis URL (default: $SLUICE_REDIS_URL)")
    p.add_argument("--namespace", default="default", help="bus namespace (keys sluice:{namespace}:...)")
    p.add_argument("--router-id", default="router",
                   help="stable id: names this router's consumer groups, so a restart resumes them")
    p.add_argument("--policy", default="score", help=f"one of: {', '.join(x.value for x in RoutingPolicy)}")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before GONE")
    p.add_argument("--prediction-ttl", type=float, default=2.0, help="seconds a routing decision counts as cached")
    p.add_argument("--seed", type=int, default=0, help="tie-break seed")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code (2 on a configuration error)."""
    if not args.redis_url:
        log.error("no Redis: pass --redis-url or set SLUICE_REDIS_URL")
        return 2
    try:
        config = RouterConfig(policy=RoutingPolicy.parse(args.policy), prediction_ttl_s=args.prediction_ttl,
                              heartbeat_timeout_s=args.heartbeat_timeout, seed=args.seed)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    setup_tracing("sluice-router")
    metrics = RouterMetrics()
    if args.metrics_port is not None:
        serve_metrics(metrics.registry, args.metrics_port)
    client = aioredis.Redis.from_url(args.redis_url)
    runtime = RouterRuntime(RouterCore(config), Bus(client, args.namespace), args.router_id, metrics=metrics)
    server, port = await start_router_server(runtime, args.port, args.host)
    print(f"router listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runtime.run(stop)
    await runtime.health.enter_graceful_shutdown()
    await server.stop(1.0)
    await client.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
