"""The deployment files start each service with flags its own parser accepts, on the ports the others dial."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from admission_svc.__main__ import build_parser as admission_parser
from router_svc.__main__ import build_parser as router_parser
from scheduler_svc.__main__ import build_parser as scheduler_parser
from worker_svc.__main__ import build_parser as worker_parser

yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PARSERS = {"admission": admission_parser, "router": router_parser, "scheduler": scheduler_parser,
           "worker": worker_parser}


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


def test_dockerfiles_expose_the_port_their_entrypoint_listens_on() -> None:
    """Each Dockerfile EXPOSEs the --port its ENTRYPOINT passes, and binds every interface."""
    required = {"scheduler": ["--replica-id", "r", "--worker", "w:1"]}
    for service in PARSERS:
        args = parse(service, required.get(service, []))
        exposed = re.search(r"^EXPOSE (\d+)$", (DEPLOY / "docker" / f"{service}.Dockerfile").read_text(), re.M)
        assert exposed and int(exposed.group(1)) == args.port and args.host == "0.0.0.0", service


def test_compose_commands_parse_and_dial_the_right_ports() -> None:
    """Every compose service's command is accepted by its parser, and each address it dials names a service on its port."""
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
    assert admission["ports"] == [f"{ports['admission']}:{ports['admission']}"]


def test_k8s_args_parse_and_match_container_ports() -> None:
    """Every Sluice container's args are accepted by its parser, and its gRPC containerPort is the port it listens on."""
    seen = set()
    for service, container in k8s_containers():
        args = parse(service, container.get("args", []))
        grpc_ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == "grpc"]
        assert grpc_ports == [args.port], f"{container['name']}: containerPort {grpc_ports} vs --port {args.port}"
        probe = container.get("readinessProbe", {})
        probed = (probe.get("grpc") or probe.get("tcpSocket") or {}).get("port")
        assert probed == args.port, f"{container['name']} probes port {probed}, listens on {args.port}"
        seen.add(service)
    assert seen == set(PARSERS)
