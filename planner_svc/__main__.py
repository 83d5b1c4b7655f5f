"""`python -m planner_svc`: run the planner (observe the fleet, decide, scale it) as a service.

Every `--period` seconds it observes the fleet through the router and the replicas' schedulers
(planner_svc.observe), asks the core for a decision and carries a change out through the connector:
`kubernetes` sets the replica Deployment's size through its scale subresource (in-cluster credentials,
or `--kubeconfig`), `prometheus` only publishes `sluice_planner_desired_replicas` for an external
autoscaler (docs/planner.md). Its gRPC port serves only gRPC health (SERVING while the loop runs), for
`python -m sluice.healthcheck PORT --role planner`; `--metrics-port` serves PlannerMetrics.

`--pools` sizes a disaggregated fleet (schedulers with `--role prefill` and `--role decode`) as two pools
apart: `PoolPlannerLoop` over the pool planner (planner_svc/pools.py), each pool within `--min-replicas`..
`--max-replicas`, each pool's decision carried out by its own connector: `kubernetes` scales
`--prefill-deployment` and `--decode-deployment`, `prometheus` publishes `sluice_planner_pool_desired_replicas`
per pool; `--metrics-port` then serves PoolPlannerMetrics. A flag that does not go with the others ends the
process at once with one line naming it (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from planner_svc.config import PlannerConfig
from planner_svc.connectors import (
    KubernetesConnector,
    PoolPrometheusConnector,
    PrometheusConnector,
    ReplicaConnector,
)
from planner_svc.core import Planner
from planner_svc.driver import (
    ObservationSource,
    PlannerLoop,
    PlannerMetrics,
    PoolPlannerLoop,
    PoolPlannerMetrics,
)
from planner_svc.observe import RouterObservations
from planner_svc.pools import PoolPlanner, PoolsConfig
from sluice import serve
from sluice.types import ReplicaRole

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from prometheus_client import CollectorRegistry

log = logging.getLogger("sluice.planner")
_DEFAULTS = PlannerConfig()
CONNECTORS = ("kubernetes", "prometheus")
DEPLOYMENT = "replica"
POOL_DEPLOYMENTS = {ReplicaRole.PREFILL: "replica-prefill", ReplicaRole.DECODE: "replica-decode"}


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
    deployment: str = DEPLOYMENT
    """Name of the replica Deployment the kubernetes connector scales (an aggregated fleet; not with --pools)."""
    pools: bool = False
    """Size the prefill and decode pools of a disaggregated fleet apart, each within --min-replicas..--max-replicas:
    kubernetes scales --prefill-deployment and --decode-deployment, prometheus publishes a figure per pool."""
    prefill_deployment: str | None = None
    """With --pools: the Deployment of the prefill replicas (--role prefill); None: replica-prefill."""
    decode_deployment: str | None = None
    """With --pools: the Deployment of the decode replicas (--role decode); None: replica-decode."""
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
    """Return the planner's options. argparse exits 2 with a usage message on a bad flag; a combination of flags
    that does not go together exits 2 with one line naming the flag (`options_problem`)."""
    parser = build_parser()
    options = serve.load_options(PlannerOptions, parser, argv)
    problem = options_problem(options)
    if problem:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    return options


def options_problem(options: PlannerOptions) -> str:
    """Return what is wrong with the combination of flags, naming the flag ("" when nothing)."""
    if not options.pools:
        named = [flag for flag, value in (("--prefill-deployment", options.prefill_deployment),
                                          ("--decode-deployment", options.decode_deployment)) if value is not None]
        return f"{named[0]} names a pool's Deployment: it needs --pools" if named else ""
    if options.deployment != DEPLOYMENT:
        return ("--deployment names the one Deployment of an aggregated fleet; with --pools name "
                "--prefill-deployment and --decode-deployment")
    prefill, decode = pool_deployments(options).values()
    if prefill == decode:
        return f"--prefill-deployment and --decode-deployment must name two Deployments, both name {prefill!r}"
    return ""


def pool_deployments(options: PlannerOptions) -> dict[ReplicaRole, str]:
    """Return the Deployment of each pool (prefill, then decode) that --pools with the kubernetes connector scales."""
    return {ReplicaRole.PREFILL: options.prefill_deployment or POOL_DEPLOYMENTS[ReplicaRole.PREFILL],
            ReplicaRole.DECODE: options.decode_deployment or POOL_DEPLOYMENTS[ReplicaRole.DECODE]}


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
    return KubernetesConnector(kubernetes_api(options), namespace=options.kube_namespace, deployment=options.deployment)


def build_pool_connectors(options: PlannerOptions, metrics: PoolPlannerMetrics) -> dict[ReplicaRole, ReplicaConnector]:
    """Return each pool's connector (--pools): the kubernetes connector of its Deployment (`pool_deployments`), or
    the prometheus connector of its figure. Raises serve.StartupError when Kubernetes credentials are missing."""
    if options.connector == "prometheus":
        return {role: PoolPrometheusConnector(metrics, role.value) for role in POOL_DEPLOYMENTS}
    api = kubernetes_api(options)
    return {role: KubernetesConnector(api, namespace=options.kube_namespace, deployment=deployment)
            for role, deployment in pool_deployments(options).items()}


def kubernetes_api(options: PlannerOptions) -> ApiClient:
    """Return a Kubernetes API client: --kubeconfig's, else the pod's service account. Raises serve.StartupError
    when there are no credentials."""
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
    return api


class PlannerTicks(Protocol):
    """What the service runs every period: PlannerLoop, or PoolPlannerLoop with --pools."""

    def tick(self, now: float) -> object:
        """Observe at `now`, decide, carry out the change(s); return the decision(s)."""
        ...


def build_loop(options: PlannerOptions, config: PlannerConfig,
               source: ObservationSource) -> tuple[PlannerTicks, CollectorRegistry]:
    """Return the planner loop the options ask for and the registry of its metrics: one fleet, or with --pools the
    prefill and decode pools, each sized by `config`. Raises serve.StartupError when Kubernetes credentials are
    missing."""
    if options.pools:
        pool_metrics = PoolPlannerMetrics()
        planner = PoolPlanner(PoolsConfig(prefill=config, decode=config))
        connectors = build_pool_connectors(options, pool_metrics)
        return PoolPlannerLoop(planner, source, connectors, pool_metrics), pool_metrics.registry
    metrics = PlannerMetrics()
    return PlannerLoop(Planner(config), source, build_connector(options, metrics), metrics), metrics.registry


def describe_sizing(options: PlannerOptions, config: PlannerConfig) -> str:
    """Return what the planner sizes, for the start-up line."""
    bounds = f"{config.min_replicas}..{config.max_replicas} replicas"
    if not options.pools:
        return bounds
    if options.connector == "prometheus":
        return f"prefill and decode pools, each {bounds}"
    prefill, decode = pool_deployments(options).values()
    return f"prefill pool {prefill} and decode pool {decode}, each {bounds}"


async def run_loop(loop: PlannerTicks, period_s: float, stop: asyncio.Event) -> None:
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
    files = serve.tls_files(options, "planner")
    loop, registry = build_loop(options, config, RouterObservations(options.router, files))
    ctx.expose_metrics(registry)
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
                                f"{describe_sizing(options, config)})")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a configuration error)."""
    options = parse_args(argv)
    return serve.run_service("planner", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
