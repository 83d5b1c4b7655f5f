"""The Kubernetes manifests run every internal hop over mutual TLS, as `sluice up` does, and can still probe it.

Structure (read from deploy/k8s): each Sluice container runs with --tls-dir on a mount of its own role's
Secret laid out as sluice.tls.TlsFiles reads it; mTLS ports are probed by sluice.healthcheck; schedulers
advertise a DNS name their certificate can carry. Function (real files, real gRPC on loopback): the
certificates made by the recipe in extras/tls-secrets.example.yaml, laid out by the manifests' volume
items, serve health to `python -m sluice.healthcheck`, and a scheduler's certificate verifies under the
name its pod registers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from test_deploy import PARSERS, k8s_containers, parse

from sluice import tls

yaml = pytest.importorskip("yaml")
K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TLS_DIR = "/etc/sluice/tls"
EXAMPLE = (K8S / "extras" / "tls-secrets.example.yaml").read_text()
RECIPE_HOSTS = ["localhost", "127.0.0.1", "router", "router.sluice.svc", "router.sluice.svc.cluster.local",
                "*.replica.sluice.svc.cluster.local"]


def pods() -> dict[str, dict[str, Any]]:
    """Return each Deployment's pod template spec by Deployment name."""
    return {doc["metadata"]["name"]: doc["spec"]["template"]["spec"] for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "Deployment"}


def tls_volume(container: dict[str, Any]) -> dict[str, Any]:
    """Return the pod volume the container mounts at TLS_DIR."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR)
    pod = next(p for p in pods().values() if container in p["containers"])
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


def test_every_sluice_container_runs_mtls_with_its_own_roles_secret() -> None:
    """--tls-dir and $SLUICE_TLS_DIR name the mount of Secret sluice-tls-<role> (required, not optional), whose
    keys ca.crt, tls.crt, tls.key become ca.pem, <role>.pem, <role>-key.pem: the files TlsFiles.of reads."""
    seen = set()
    for service, container in k8s_containers():
        assert parse(service, container.get("args", [])).tls_dir == TLS_DIR, container["name"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("SLUICE_TLS_DIR") == TLS_DIR, container["name"]
        secret = tls_volume(container)["secret"]
        assert secret["secretName"] == f"sluice-tls-{service}" and not secret.get("optional", False)
        layout = {item["key"]: item["path"] for item in secret["items"]}
        assert layout == {"ca.crt": "ca.pem", "tls.crt": f"{service}.pem", "tls.key": f"{service}-key.pem"}
        assert f"sluice-tls-{service}" in EXAMPLE
        seen.add(service)
    assert seen == set(PARSERS)


def test_mtls_ports_are_probed_with_sluice_healthcheck_and_plaintext_ones_by_the_kubelet() -> None:
    """The kubelet's gRPC probe cannot present a certificate: every probe of a port that requires one runs
    sluice.healthcheck with the container's role; admission's public port (no --public-tls) keeps the gRPC probe."""
    for service, container in k8s_containers():
        args = parse(service, container.get("args", []))
        mtls_port = service != "admission" or getattr(args, "public_tls", False)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            if mtls_port:
                assert probe["exec"]["command"] == ["python", "-m", "sluice.healthcheck", str(args.port),
                                                    "--role", service], (container["name"], kind)
            else:
                assert probe["grpc"]["port"] == args.port, (container["name"], kind)


def test_a_scheduler_advertises_the_dns_name_its_pod_gets_and_its_certificate_names() -> None:
    """The replica pod's subdomain is a headless Service that publishes not-ready pods too (warming and draining
    replicas are still called), and the scheduler registers <pod name>.<subdomain>.<namespace>.svc.cluster.local,
    which the recipe's wildcard host covers."""
    docs = [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    replica = pods()["replica"]
    scheduler = next(c for c in replica["containers"] if c["name"] == "scheduler")
    args = parse("scheduler", scheduler["args"])
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == replica["subdomain"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    namespace = service["metadata"]["namespace"]
    assert args.advertise_host == f"$(POD_NAME).{replica['subdomain']}.{namespace}.svc.cluster.local"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in scheduler["env"]
    assert f"*.{replica['subdomain']}.{namespace}.svc.cluster.local" in RECIPE_HOSTS
    for host in RECIPE_HOSTS:
        assert f"'{host}'" in EXAMPLE, host


def _secret_volume(tmp_path: Path, pki: Path, role: str) -> Path:
    """Lay the role's Secret (cert-manager keys) out as the manifest's volume items do; return the directory."""
    secret = {"ca.crt": pki / "ca.pem", "tls.crt": pki / f"{role}.pem", "tls.key": pki / f"{role}-key.pem"}
    container = next(c for s, c in k8s_containers() if s == role)
    mounted = tmp_path / f"mount-{role}"
    mounted.mkdir()
    for item in tls_volume(container)["secret"]["items"]:
        (mounted / item["path"]).write_bytes(secret[item["key"]].read_bytes())
    return mounted


async def _serve(files: tls.TlsFiles, status: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = tls.listen(server, "localhost:0", files)
    await server.start()
    return server, port


def _probe(port: int, role: str, tls_dir: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_TLS_DIR"}
    if tls_dir is not None:
        env["SLUICE_TLS_DIR"] = str(tls_dir)
    return subprocess.run([sys.executable, "-m", "sluice.healthcheck", str(port), "--role", role], env=env,
                          capture_output=True, text=True, timeout=30, check=False)


def test_the_recipes_certificates_in_the_manifests_layout_pass_the_probe(tmp_path: Path) -> None:
    """For router, scheduler and worker, a server started from the mounted layout answers sluice.healthcheck:
    exit 0 while SERVING, 1 while NOT_SERVING, 1 without a certificate (the server requires one)."""
    pki = tls.write_local_pki(tmp_path / "pki", hosts=RECIPE_HOSTS)

    async def body() -> None:
        for role in ("router", "scheduler", "worker"):
            mounted = _secret_volume(tmp_path, pki, role)
            files = tls.TlsFiles.of(mounted, role)
            for status, expected in ((health_pb2.HealthCheckResponse.SERVING, 0),
                                     (health_pb2.HealthCheckResponse.NOT_SERVING, 1)):
                server, port = await _serve(files, status)
                try:
                    result = await asyncio.to_thread(_probe, port, role, mounted)
                    assert result.returncode == expected, (role, result.stdout, result.stderr)
                    if expected == 0:
                        plain = await asyncio.to_thread(_probe, port, role, None)
                        assert plain.returncode == 1 and "not serving" in plain.stdout, plain.stdout
                finally:
                    await server.stop(None)
    asyncio.run(body())


def test_a_scheduler_certificate_verifies_under_its_pods_registered_name_only(tmp_path: Path) -> None:
    """Admission's channel to a scheduler named <pod>.replica.sluice.svc.cluster.local verifies the wildcard
    certificate; the same certificate under a name it does not carry is refused (UNAVAILABLE)."""
    pki = tls.write_local_pki(tmp_path / "pki", hosts=RECIPE_HOSTS)

    async def check(name: str) -> grpc.StatusCode:
        options = [("grpc.ssl_target_name_override", name)]
        async with tls.aio_channel(f"127.0.0.1:{port}", tls.TlsFiles.of(pki, "admission"), options) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    async def body() -> list[grpc.StatusCode]:
        nonlocal port
        server, port = await _serve(tls.TlsFiles.of(pki, "scheduler"), health_pb2.HealthCheckResponse.SERVING)
        try:
            return [await check("replica-7d9f-abcde.replica.sluice.svc.cluster.local"),
                    await check("replica-7d9f-abcde.other.sluice.svc.cluster.local")]
        finally:
            await server.stop(None)
    port = 0
    assert asyncio.run(body()) == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE]
