"""`python -m planner_svc`: run the planner (observe the fleet, decide, scale it) as a service.

Every `--period` seconds it observes the fleet through the router and the replicas' schedulers
(planner_svc.observe), asks the core for a decision and carries a change out through the connector:
`kubernetes` sets the replica Deployment's size through its scale subresource (in-cluster credentials,
or `--kubeconfig`), `prometheus` only publishes `sluice_planner_desired_replicas` for an external
autoscaler (docs/planner.md). Its gRPC port serves only gRPC health (SERVING while the loop runs), for
`python -m sluice.healthcheck PORT --role planner`; `--metrics-port` serves PlannerMetrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_svc.config import PlannerConfig
from planner_svc.connectors import KubernetesConnector, PrometheusConnector, ReplicaConnector
from planner_svc.core import Planner
from planner_svc.driver import PlannerLoop, PlannerMetrics
from planner_svc.observe import RouterObservations
from sluice import serve

log = logging.getLogger("sluice.planner")
_DEFAULTS = PlannerConfig()
CONNECTORS = ("kubernetes", "prometheus")


@dataclass(frozen=True, kw_only=True)
class PlannerOptions(serve.ServiceOptions):
    """The planner's flags; the sizing settings default to PlannerConfig's (docs/planner.md)."""

    port: int = 50081
    """gRPC port (gRPC health only); 0 picks a free one."""
    router: str = "127.0.0.1:50052"
    """host:port of the router whose registry lists the replicas."""
    connector: str = field(default="kubernetes", metadata={"choices": CONNECTORS})
    """How a decision is carried out: kubernetes (scale the Deployment) or prometheus (publish the figure only)."""
    kube_namespace: str = field(default="sluice", metadata={"env": "POD_NAMESPACE"})
    """Kubernetes namespace of the replica Deployment."""
    deployment: str = "replica"
    """Name of the replica Deployment the kubernetes connector scales."""
    kubeconfig: str = ""
    """kubeconfig file for the kubernetes connector; empty: the pod's in-cluster service account."""
    period: float = 5.0
    """Seconds between two observations."""
    min_replicas: int = _DEFAULTS.min_replicas
    """Fewest replicas kept, whatever the load."""
    max_replicas: int = _DEFAULTS.max_replicas
    """Most replicas asked for, whatever the load."""
    window: float = _DEFAULTS.window_s
    """Observation window in seconds."""
    cooldown: float = _DEFAULTS.cooldown_s
    """Least seconds between two changes of the replica count."""
    load_time: float = _DEFAULTS.load_time_s
    """Seconds from start to weights loaded on a new replica."""
    warmup: float = _DEFAULTS.warmup_s
    """Seconds from weights loaded to the first routed request."""
    ttft_slo: float = _DEFAULTS.ttft_slo_s
    """Time-to-first-token target in seconds."""
    tpot_slo: float = _DEFAULTS.tpot_slo_s
    """Time-per-output-token target in seconds."""
    queue_per_replica: float = _DEFAULTS.queue_per_replica
    """Queued requests per ready replica that count as pressure 1."""


def build_parser() -> Any:
    """Return the command-line parser of the planner (one flag per PlannerOptions field)."""
    return serve.options_parser(PlannerOptions, prog="python -m planner_svc", description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> PlannerOptions:
    """Return the planner's options (argparse exits with a usage message on bad flags)."""
    return serve.load_options(PlannerOptions, build_parser(), argv)


def planner_config(options: PlannerOptions) -> PlannerConfig:
    """Return the core's configuration; raises serve.StartupError naming what is out of range."""
    if options.period <= 0:
        raise serve.StartupError(f"--period must be > 0, got {options.period}")
    try:
        return PlannerConfig(min_replicas=options.min_replicas, max_replicas=options.max_replicas,
                             window_s=options.window, cooldown_s=options.cooldown, load_time_s=options.load_time,
                             warmup_s=options.warmup, ttft_slo_s=options.ttft_slo, tpot_slo_s=options.tpot_slo,
                             queue_per_replica=options.queue_per_replica)
    except ValueError as exc:
        raise serve.StartupError(str(exc)) from exc


def build_connector(options: PlannerOptions, metrics: PlannerMetrics) -> ReplicaConnector:
    """Return the connector the options name; raises serve.StartupError when Kubernetes credentials are missing."""
    if options.connector == "prometheus":
        return PrometheusConnector(metrics)
    from kubernetes import client, config

    try:
        if options.kubeconfig:
            api = config.new_client_from_config(config_file=options.kubeconfig)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
    except (config.ConfigException, OSError) as exc:
        raise serve.StartupError(f"no Kubernetes credentials ({exc}); run in a pod with a service account, "
                                 "pass --kubeconfig, or use --connector prometheus") from exc
    return KubernetesConnector(api, namespace=options.kube_namespace, deployment=options.deployment)


async def run_loop(loop: PlannerLoop, period_s: float, stop: asyncio.Event) -> None:
    """Tick the planner every `period_s` (in a thread: the connectors block) until `stop`; a failed action is logged."""
    while not stop.is_set():
        try:
            decision = await asyncio.to_thread(loop.tick, time.monotonic())
            log.debug("planner decision: %s", decision)
        except Exception as exc:  # an API error of the connector: the cooldown holds the next change anyway
            log.error("planner action failed: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


async def start(ctx: serve.ServiceContext, options: PlannerOptions) -> serve.Started:
    """Start the health server and the planner loop; returns how to drain them."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from sluice import tls

    config = planner_config(options)
    metrics = PlannerMetrics()
    files = serve.tls_files(options, "planner")
    connector = build_connector(options, metrics)
    ctx.expose_metrics(metrics.registry)
    source = RouterObservations(options.router, files)
    loop = PlannerLoop(Planner(config), source, connector, metrics)
    server = serve.grpc_server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = tls.listen(server, f"{options.host}:{options.port}", files)
    if port == 0:
        raise serve.StartupError(f"cannot bind the planner to {options.host}:{options.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    task = asyncio.create_task(run_loop(loop, options.period, ctx.stop))

    async def drain() -> None:
        await task
        await health_servicer.enter_graceful_shutdown()
        await server.stop(1.0)

    return serve.Started(port, drain=drain, watched=[task], health=health_servicer,
                         detail=f" (router {options.router}, connector {options.connector}, "
                                f"{config.min_replicas}..{config.max_replicas} replicas)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a configuration error)."""
    options = parse_args(argv)
    return serve.run_service("planner", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
