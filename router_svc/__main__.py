"""`python -m router_svc`: run the router (replica registry, prefix index, scoring) as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from router_svc.core import RouterConfig, RouterCore, RoutingPolicy
from router_svc.server import SERVICE_NAME, RouterRuntime, start_router_server
from sluice import serve
from sluice.prom import RouterMetrics

_CORE = RouterConfig()
"""The core's defaults, which the flags share."""


@dataclass(frozen=True, kw_only=True)
class RouterOptions(serve.BusOptions):
    """The router's flags; the core's settings default to RouterConfig's (written there once)."""

    port: int = 50052
    """gRPC port; 0 picks a free one."""
    router_id: str = "router"
    """Stable id naming this router's consumer groups, so that a restart resumes them."""
    policy: str = _CORE.policy.value
    """Routing policy: score, round_robin, random, least_loaded, prefix_only, dynamo_kv or llm_d (RoutingPolicy)."""
    heartbeat_timeout: float = _CORE.heartbeat_timeout_s
    """Seconds of replica silence before it is GONE."""
    prediction_ttl: float = _CORE.prediction_ttl_s
    """Seconds a routing decision counts as cached."""
    seed: int = _CORE.seed
    """Tie-break seed."""
    prefill_weight: float = _CORE.prefill_weight
    """Score policy: weight of a request's own uncached prefill when comparing replicas (>1 values cache hits
    more; the simulator's Mooncake comparison in docs/simulator.md found 4 better for long shared prompts)."""
    load_bound: float = _CORE.load_bound
    """Score policy: at 1 or above, skip replicas holding load_bound x the mean outstanding requests (bounded
    loads); 0 turns the bound off."""
    tenant_spread: int = _CORE.tenant_spread
    """Score policy: at 1 or above, skip replicas holding more than this many routed requests of the caller's
    tenant beyond the least one (fleet-wide fair share from per-replica fair queues); 0 turns it off."""
    ttft_target: float = _CORE.ttft_target_s
    """Score policy with a prefill weight: seconds; the weight ranks only replicas predicted to meet this TTFT
    (the lowest predicted TTFT wins when none would); set it to admission's TTFT SLO; 0 turns it off."""


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of the router (one flag per RouterOptions field)."""
    return serve.options_parser(RouterOptions, prog="python -m router_svc", description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> RouterOptions:
    """Return the router's options (argparse exits with a usage message on bad flags)."""
    return serve.load_options(RouterOptions, build_parser(), argv)


def router_config(options: RouterOptions) -> RouterConfig:
    """Return the core's configuration; raises serve.StartupError for an unknown policy or a bad value."""
    if options.tenant_spread < 0:
        raise serve.StartupError(f"--tenant-spread must be >= 0, got {options.tenant_spread}")
    if options.prefill_weight <= 0:
        raise serve.StartupError(f"--prefill-weight must be > 0, got {options.prefill_weight}")
    if not 0 <= options.ttft_target < float("inf"):
        raise serve.StartupError(f"--ttft-target must be a finite number of seconds >= 0, got {options.ttft_target}")
    try:
        return RouterConfig(policy=RoutingPolicy.parse(options.policy), prediction_ttl_s=options.prediction_ttl,
                            heartbeat_timeout_s=options.heartbeat_timeout, seed=options.seed,
                            prefill_weight=options.prefill_weight, load_bound=options.load_bound,
                            tenant_spread=options.tenant_spread, ttft_target_s=options.ttft_target)
    except ValueError as exc:
        raise serve.StartupError(str(exc)) from exc


async def start(ctx: serve.ServiceContext, options: RouterOptions) -> serve.Started:
    """Start the router's server and its bus loop; returns how to drain it."""
    config = router_config(options)
    metrics = RouterMetrics()
    ctx.expose_metrics(metrics.registry)
    bus = await serve.open_bus(ctx, options)
    files = serve.tls_files(options, "router")
    runtime = RouterRuntime(RouterCore(config), bus, options.router_id, metrics=metrics, tls_files=files)
    server, port = await start_router_server(runtime, options.port, options.host, files)
    loop = asyncio.create_task(runtime.run(ctx.stop))

    async def drain() -> None:
        await loop
        await runtime.health.enter_graceful_shutdown()
        await server.stop(1.0)

    return serve.Started(port, drain=drain, watched=[loop], health=runtime.health,
                         health_names=("", SERVICE_NAME))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a configuration error)."""
    options = parse_args(argv)
    return serve.run_service("router", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
