"""Planner connectors over real HTTP: the official kubernetes client against a loopback API server, the Prometheus gauges scraped, local processes started and stopped."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from planner_svc.__main__ import build_loop, parse_args, planner_config
from planner_svc.config import PlannerConfig
from planner_svc.connectors import (
    POD_DELETION_COST_ANNOTATION,
    VICTIM_DELETION_COST,
    KubernetesConnector,
    LocalProcessConnector,
    PrometheusConnector,
    apply_decision,
)
from planner_svc.core import Hold, HoldReason, Planner, ScaleDown, ScaleUp
from planner_svc.driver import PlannerLoop, PlannerMetrics
from planner_svc.pools import PoolDecisions
from planner_svc.signals import Observation, ReplicaLoad
from sluice.prom import serve_metrics
from sluice.types import ReplicaRole
from tests.integration.fake_kube_api import ClusterState, serve


@pytest.fixture
def cluster() -> Iterator[tuple[ClusterState, KubernetesConnector]]:
    """A fake API server holding Deployment 'replica' at 2 pods, and a connector using the real client on it."""
    state = ClusterState(deployments={"replica": 2}, pods={"replica-a": {}, "replica-b": {}})
    server = serve(state)
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    with client.ApiClient(config) as api:
        yield state, KubernetesConnector(api, namespace="sluice", deployment="replica")
    server.shutdown()
    server.server_close()


def test_kubernetes_reads_the_scale_subresource(cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """current_replicas is spec.replicas from GET .../deployments/replica/scale."""
    state, connector = cluster
    assert connector.current_replicas() == 2
    assert state.requests[-1][:2] == ("GET", "/apis/apps/v1/namespaces/sluice/deployments/replica/scale")


def test_kubernetes_scale_up_writes_the_scale_with_the_read_version(
        cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """ScaleUp(2) PUTs a Scale of 4 replicas carrying the resourceVersion it read."""
    state, connector = cluster
    assert apply_decision(connector, ScaleUp(2)) is True
    assert state.deployments["replica"] == 4
    method, path, _, body = state.requests[-1]
    assert (method, path) == ("PUT", "/apis/apps/v1/namespaces/sluice/deployments/replica/scale")
    assert body["spec"]["replicas"] == 4 and body["metadata"]["resourceVersion"] == "1"


def test_kubernetes_retries_a_write_that_lost_a_race(cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """Another writer scales to 3 between our read and write: the 409 is re-read, and 3 + 1 = 4 results."""
    state, connector = cluster
    state.races = 1
    connector.add(1)
    assert state.deployments["replica"] == 4
    puts = [body["spec"]["replicas"] for method, _, _, body in state.requests if method == "PUT"]
    assert puts == [3, 4]  # the stale write of 2 + 1 (refused with 409), then 3 + 1 after reading again


def test_kubernetes_gives_up_after_its_conflict_retries(cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """A race lost on every attempt ends in the API's 409, not a silent success or an endless loop."""
    state, connector = cluster
    state.races = 100
    with pytest.raises(ApiException) as raised:
        connector.add(1)
    assert raised.value.status == 409
    assert sum(1 for method, *_ in state.requests if method == "PUT") == connector.conflict_retries + 1


def test_kubernetes_scale_down_marks_the_victim_pod_first(cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """ScaleDown('replica-b') merge-patches that pod's deletion cost, then scales the Deployment to 1."""
    state, connector = cluster
    apply_decision(connector, ScaleDown("replica-b"))
    assert state.pods["replica-b"] == {POD_DELETION_COST_ANNOTATION: VICTIM_DELETION_COST}
    assert state.pods["replica-a"] == {}
    assert state.deployments["replica"] == 1
    patch = next(r for r in state.requests if r[0] == "PATCH")
    assert patch[1:3] == ("/api/v1/namespaces/sluice/pods/replica-b", "application/merge-patch+json")


def test_kubernetes_removing_an_unknown_pod_scales_nothing(cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """A victim that is not a pod raises the API's 404, and the Deployment keeps its 2 replicas."""
    state, connector = cluster
    with pytest.raises(ApiException) as raised:
        connector.remove("replica-zzz")
    assert raised.value.status == 404 and state.deployments["replica"] == 2


def test_a_hold_touches_nothing(cluster: tuple[ClusterState, KubernetesConnector]) -> None:
    """apply_decision(Hold) makes no API call and reports no change."""
    state, connector = cluster
    assert apply_decision(connector, Hold(HoldReason.COOLDOWN)) is False
    assert state.requests == []


class UnevenPools:
    """Pods of the two pools as the router lists them: one prefill replica, three decode replicas (the idle one,
    replica-decode-c, is the cheapest to retire)."""

    def observe(self, now: float) -> Observation:
        decode = tuple(ReplicaLoad(f"replica-decode-{name}", in_flight=0 if name == "c" else 2, role=ReplicaRole.DECODE)
                       for name in "abc")
        return Observation(at=now, arrival_rate=1.0,
                           replicas=(ReplicaLoad("replica-prefill-a", role=ReplicaRole.PREFILL), *decode))


def test_the_planner_service_with_pools_scales_each_pools_deployment(tmp_path: Path) -> None:
    """`python -m planner_svc --pools` (kubernetes connector, credentials from --kubeconfig) against the API server:
    the prefill pool under its minimum raises Deployment replica-prefill's scale, the decode pool over its maximum
    marks its idle pod and lowers replica-decode's, and neither touches the other's Deployment."""
    state = ClusterState(deployments={"replica-prefill": 1, "replica-decode": 3, "replica": 5},
                         pods={f"replica-decode-{name}": {} for name in "abc"})
    server = serve(state)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "planner", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "planner"}}]}))
    try:
        options = parse_args(["--pools", "--kubeconfig", str(kubeconfig), "--kube-namespace", "sluice",
                              "--min-replicas", "2", "--max-replicas", "2"])
        loop, _registry = build_loop(options, planner_config(options), UnevenPools())
        assert loop.tick(0.0) == PoolDecisions(ScaleUp(1, "bounds"), ScaleDown("replica-decode-c", "bounds"))
    finally:
        server.shutdown()
        server.server_close()
    assert state.deployments == {"replica-prefill": 2, "replica-decode": 2, "replica": 5}
    assert state.pods["replica-decode-c"] == {POD_DELETION_COST_ANNOTATION: VICTIM_DELETION_COST}
    assert state.pods["replica-decode-a"] == state.pods["replica-decode-b"] == {}
    scaled = {path.rsplit("/", 2)[-2] for method, path, _, _ in state.requests if method == "PUT"}
    assert scaled == {"replica-prefill", "replica-decode"}


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("sluice_planner")}


def test_prometheus_exports_desired_against_current() -> None:
    """A loop on a 3-replica fleet scales up by 2 then retires r1: scrapes show desired 5 then 2, current 3, r1 named."""
    metrics = PlannerMetrics()
    config = PlannerConfig(min_replicas=1, max_replicas=5, window_s=5.0, min_observations=1, cooldown_s=10.0,
                           replica_tokens_per_s=1.0, output_token_weight=0.0)
    source = FixedFleet(rate=3.0)  # pressure 1.0 on 3 replicas: ceil(3 / 0.7) = 5
    connector = PrometheusConnector(metrics)
    loop = PlannerLoop(Planner(config), source, connector, metrics)
    port = serve_metrics(metrics.registry, 0, addr="127.0.0.1")
    assert loop.tick(0.0) == ScaleUp(2, "demand", 1.0)
    scraped = _scrape(port)
    assert scraped["sluice_planner_desired_replicas"] == 5 and scraped["sluice_planner_current_replicas"] == 3
    source.rate = 0.3  # the HPA did not act: still 3 replicas, pressure 0.1 -> retire the cheapest
    assert isinstance(loop.tick(20.0), ScaleDown)
    scraped = _scrape(port)
    assert scraped["sluice_planner_desired_replicas"] == 2 and connector.current_replicas() == 3
    assert scraped['sluice_planner_retire_candidate{replica="r1"}'] == 1
    assert scraped['sluice_planner_decisions_total{kind="scale_down",reason="demand"}'] == 1


class FixedFleet:
    """Observations of replicas r0 (2 in flight), r1 (idle), r2 (1 in flight) at a settable rate."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def observe(self, now: float) -> Observation:
        fleet = (ReplicaLoad("r0", in_flight=2), ReplicaLoad("r1"), ReplicaLoad("r2", in_flight=1))
        return Observation(at=now, arrival_rate=self.rate, replicas=fleet, mean_input_tokens=1.0)


class SleeperLauncher:
    """A ReplicaLauncher whose replicas are real (idle) child processes."""

    def __init__(self) -> None:
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: list[subprocess.Popen[bytes]] = []

    def start_replica(self) -> str:
        replica_id = f"local-{len(self.processes) + len(self.stopped)}"
        self.processes[replica_id] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        return replica_id

    def stop_replica(self, replica_id: str) -> None:
        process = self.processes.pop(replica_id)
        process.terminate()
        process.wait(timeout=10)
        self.stopped.append(process)

    def replica_ids(self) -> Sequence[str]:
        return list(self.processes)


def test_local_connector_starts_and_stops_named_processes() -> None:
    """ScaleUp(2) starts two processes; ScaleDown of one stops exactly that one; an unknown id raises KeyError."""
    launcher = SleeperLauncher()
    connector = LocalProcessConnector(launcher)
    try:
        apply_decision(connector, ScaleUp(2))
        assert connector.current_replicas() == 2
        assert all(p.poll() is None for p in launcher.processes.values())
        apply_decision(connector, ScaleDown("local-0"))
        assert connector.current_replicas() == 1 and launcher.replica_ids() == ["local-1"]
        assert launcher.stopped[0].returncode is not None
        with pytest.raises(KeyError):
            connector.remove("local-0")
    finally:
        for replica_id in list(launcher.processes):
            launcher.stop_replica(replica_id)
