"""The deployment files start each service with flags its own parser accepts, on the ports the others dial."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from admission_svc.__main__ import build_parser as admission_parser
from planner_svc.__main__ import build_parser as planner_parser
from planner_svc.__main__ import parse_args as planner_args
from planner_svc.__main__ import pool_deployments
from router_svc.__main__ import build_parser as router_parser
from scheduler_svc.__main__ import build_parser as scheduler_parser
from sluice.types import ReplicaRole
from worker_svc.__main__ import build_parser as worker_parser

yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PARSERS = {"admission": admission_parser, "router": router_parser, "scheduler": scheduler_parser,
           "worker": worker_parser, "planner": planner_parser}


def entrypoint(service: str) -> list[str]:
    """Return the ENTRYPOINT of the service's Dockerfile, checking it runs `python -m <service>_svc`."""
    text = (DEPLOY / "docker" / f"{service}.Dockerfile").read_text()
    found = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    assert found, f"{service}.Dockerfile has no JSON ENTRYPOINT"
    command = json.loads(found.group(1))
    assert command[:3] == ["python", "-m", f"{service}_svc"], command
    return command[3:]


def parse(service: str, args: list[str]) -> argparse.Namespace:
    """Return the service's flags parsed from the Dockerfile ENTRYPOINT followed by `args`; fails on a bad flag."""
    try:
        return PARSERS[service]().parse_args([*entrypoint(service), *args])
    except SystemExit:
        pytest.fail(f"python -m {service}_svc rejects {[*entrypoint(service), *args]}")


def compose_services() -> Iterator[tuple[str, str, dict]]:  # type: ignore[type-arg]
    """Yield (compose name, service, definition) for every compose service built from a Sluice Dockerfile."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, spec in compose["services"].items():
        dockerfile = spec.get("build", {}).get("dockerfile", "")
        if "entrypoint" not in spec and (found := re.search(r"docker/(\w+)\.Dockerfile$", dockerfile)):
            yield name, found.group(1), spec


def k8s_containers() -> Iterator[tuple[str, dict]]:  # type: ignore[type-arg]
    """Yield (service, container) for every container of the Kubernetes manifests running a Sluice image."""
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    found = re.match(r"sluice-(\w+):", container["image"])
                    if found and "command" not in container:
                        yield found.group(1), container


def probed_port(service: str, probe: dict) -> int | None:  # type: ignore[type-arg]
    """Return the port a probe asks: the kubelet's gRPC probe, or sluice.healthcheck with the service's own role."""
    if "grpc" in probe or "tcpSocket" in probe:
        return int((probe.get("grpc") or probe["tcpSocket"])["port"])
    command = probe.get("exec", {}).get("command", [])
    if command[:3] != ["python", "-m", "sluice.healthcheck"] or command[4:] != ["--role", service]:
        return None
    return int(command[3])


def test_dockerfiles_expose_the_port_their_entrypoint_listens_on() -> None:
    """Each Dockerfile EXPOSEs the --port its ENTRYPOINT passes, and binds every interface."""
    required = {"scheduler": ["--replica-id", "r", "--worker", "w:1"]}
    for service in PARSERS:
        args = parse(service, required.get(service, []))
        exposed = re.search(r"^EXPOSE (\d+)$", (DEPLOY / "docker" / f"{service}.Dockerfile").read_text(), re.M)
        assert exposed and int(exposed.group(1)) == args.port and args.host == "0.0.0.0", service


def test_compose_commands_parse_and_dial_the_right_ports() -> None:
    """Every compose service's command is accepted by its parser, each address it dials names a service on its port,
    and admission publishes its gRPC and HTTP ports."""
    ports = {name: parse(service, spec.get("command", [])).port for name, service, spec in compose_services()}
    assert set(ports) == {"router", "worker-0", "scheduler-0", "admission"}
    for _name, service, spec in compose_services():
        args = parse(service, spec.get("command", []))
        for flag in ("router", "worker"):
            address = getattr(args, flag, None)
            if address:
                host, port = address.rsplit(":", 1)
                assert ports.get(host) == int(port), f"{service} --{flag} {address}: no such service and port"
    admission = next(spec for name, _, spec in compose_services() if name == "admission")
    http_port = parse("admission", admission.get("command", [])).http_port  # the OpenAI-compatible HTTP API
    assert http_port is not None
    assert admission["ports"] == [f"{ports['admission']}:{ports['admission']}", f"{http_port}:{http_port}"]


def test_k8s_args_parse_and_match_container_ports() -> None:
    """Every Sluice container's args are accepted by its parser, and its gRPC containerPort is the port it listens on."""
    seen = set()
    for service, container in k8s_containers():
        args = parse(service, container.get("args", []))
        grpc_ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == "grpc"]
        assert grpc_ports == [args.port], f"{container['name']}: containerPort {grpc_ports} vs --port {args.port}"
        probed = probed_port(service, container.get("readinessProbe", {}))
        assert probed == args.port, f"{container['name']} probes port {probed}, listens on {args.port}"
        seen.add(service)
    assert seen == set(PARSERS)


def test_prometheus_scrapes_every_compose_service_on_its_metrics_port() -> None:
    """deploy/prometheus.yml has a target for each compose service at the --metrics-port it is started with."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = {f"{name}:{parse(service, spec.get('command', [])).metrics_port}"
                for name, service, spec in compose_services()}
    assert None not in {parse(s, spec.get("command", [])).metrics_port for _, s, spec in compose_services()}
    assert expected <= targets, f"not scraped: {expected - targets}"
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in compose["prometheus"]["volumes"]


def test_grafana_provisions_the_dashboard_and_a_prometheus_datasource() -> None:
    """Compose mounts the provisioning files and the dashboard where the provider looks, with a datasource of the dashboard's type."""
    grafana = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":", 1) for v in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/sluice.yaml").read_text())
    folder, file = mounts["./grafana/sluice-dashboard.json"].rsplit("/", 1)
    assert folder == provider["providers"][0]["options"]["path"] and file.endswith(".json")
    dashboard = json.loads((DEPLOY / "grafana/sluice-dashboard.json").read_text())
    wanted = {v["query"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"}
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert wanted == {"prometheus"} and [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    prometheus = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["prometheus"]
    port = prometheus["ports"][0].split(":")[-1]
    assert datasources["datasources"][0]["url"] == f"http://prometheus:{port}"


def test_k8s_probes_resources_and_metrics_ports_match_each_containers_flags() -> None:
    """Every Sluice container is probed over gRPC (the kubelet's, or sluice.healthcheck over mTLS) on its --port, has CPU/memory requests and limits, and names its --metrics-port *metrics."""
    for service, container in k8s_containers():
        args = parse(service, container.get("args", []))
        for kind in ("readinessProbe", "livenessProbe"):
            assert probed_port(service, container[kind]) == args.port, f"{container['name']} {kind}"
        if "startupProbe" in container:
            assert probed_port(service, container["startupProbe"]) == args.port, container["name"]
        for level in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][level]), f"{container['name']} {level}"
        metrics = [p["containerPort"] for p in container["ports"] if p["name"].endswith("metrics")]
        assert metrics == [args.metrics_port], f"{container['name']}: metrics ports {metrics}"


def test_both_containers_of_a_replica_pod_are_scraped() -> None:
    """The replica pod declares two *metrics ports, carries no single-port annotation, and the PodMonitor lists both port names."""
    pods = {doc["metadata"]["name"]: doc["spec"]["template"] for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "Deployment"}
    names: set[str] = set()
    for name in ("replica", "admission", "router"):
        annotations = pods[name]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true"}, name
        names |= {p["name"] for c in pods[name]["spec"]["containers"] for p in c["ports"]
                  if p["name"].endswith("metrics")}
    replica_ports = [p["name"] for c in pods["replica"]["spec"]["containers"] for p in c["ports"]]
    assert sorted(p for p in replica_ports if p.endswith("metrics")) == ["metrics", "worker-metrics"]
    monitor = yaml.safe_load((DEPLOY / "k8s/extras/podmonitor.yaml").read_text())
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == names
    assert ".*metrics" in (DEPLOY / "k8s/extras/prometheus-scrape-config.yaml").read_text()


def _k8s_documents(path: str) -> dict[tuple[str, str], dict]:  # type: ignore[type-arg]
    """(kind, name) -> document of one manifest file under deploy/k8s."""
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((DEPLOY / "k8s" / path).read_text()) if d}


def _without_pool(template: dict) -> dict:  # type: ignore[type-arg]
    """A copy of a pool's pod template without its pool's marks: the role label, the scheduler's role flags."""
    template = json.loads(json.dumps(template))
    template["metadata"]["labels"].pop("sluice.io/role")
    for container in template["spec"]["containers"]:
        for flag in ("--role", "--max-prefill-chunk"):
            if flag in container.get("args", []):
                at = container["args"].index(flag)
                del container["args"][at:at + 2]
    return template  # type: ignore[no-any-return]


def test_the_disagg_example_runs_the_replica_pod_in_two_pools_and_the_planner_sizes_them_apart() -> None:
    """extras/disagg-replicas.yaml: Deployments replica-prefill and replica-decode, each 30-replica.yaml's pod plus
    its role (the scheduler's --role, a label its own selector takes and the other's does not), and the planner of
    75-planner.yaml but for flags naming exactly those two as its pools (a combination its parser accepts), under
    70-planner-rbac.yaml's binding to a Role that may scale those two and no other Deployment."""
    extras, base = _k8s_documents("extras/disagg-replicas.yaml"), _k8s_documents("30-replica.yaml")
    pools = {name: d for (kind, name), d in extras.items() if kind == "Deployment" and name != "planner"}
    assert set(pools) == {"replica-prefill", "replica-decode"}
    aggregated = base[("Deployment", "replica")]["spec"]["template"]
    for name, deployment in pools.items():
        role = name.removeprefix("replica-")
        template = deployment["spec"]["template"]
        assert template["metadata"]["labels"] == {"app": "replica", "sluice.io/role": role}
        assert deployment["spec"]["selector"] == {"matchLabels": template["metadata"]["labels"]}
        [scheduler] = [c for c in template["spec"]["containers"] if c["name"] == "scheduler"]
        args = parse("scheduler", scheduler["args"])
        assert ReplicaRole(args.role) is ReplicaRole(role)
        default = parse("scheduler", ["--replica-id", "r"]).max_prefill_chunk
        assert args.max_prefill_chunk == (args.max_num_batched_tokens if role == "prefill" else default)
        assert _without_pool(template) == aggregated, name
    [planner] = extras[("Deployment", "planner")]["spec"]["template"]["spec"]["containers"]
    options = planner_args([*entrypoint("planner"), *planner["args"]])
    assert options.pools and set(pool_deployments(options).values()) == set(pools)
    assert pool_deployments(options)[ReplicaRole.PREFILL] == "replica-prefill"
    original = _k8s_documents("75-planner.yaml")[("Deployment", "planner")]
    changed = json.loads(json.dumps(extras[("Deployment", "planner")]))
    changed["spec"]["template"]["spec"]["containers"][0]["args"] = original["spec"]["template"]["spec"]["containers"][0]["args"]
    assert changed == original
    binding = _k8s_documents("70-planner-rbac.yaml")[("RoleBinding", "planner-scale-replicas")]
    role = extras[("Role", binding["roleRef"]["name"])]
    apps = [rule for rule in role["rules"] if rule["apiGroups"] == ["apps"]]
    assert {tuple(rule["resources"]) for rule in apps} == {("deployments/scale",), ("deployments",)}
    assert all(sorted(rule["resourceNames"]) == sorted(pools) for rule in apps)
