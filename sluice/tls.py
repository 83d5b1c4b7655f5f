"""Mutual TLS between Sluice's services, and which caller may call which RPC.

Theory of operation. Every internal hop (admission -> router and schedulers, scheduler -> worker
and router, router -> schedulers, planner -> router) is a gRPC call over mutual TLS: both ends
present a certificate signed by the deployment's CA, and the server reads the caller's *role*
from its certificate (the subject's common name: ``admission``, ``router``, ``scheduler``,
``worker``, ``planner``, ``operator``). `CALLERS` says, per RPC, which roles may call it; anyone
else gets PERMISSION_DENIED before the handler runs, a caller without a certificate from the CA
cannot even connect. That is what makes tenant identity trustworthy past the front door: a
scheduler believes a Submit's `tenant` and `tenant_weight` because only admission can send one.

The public admission endpoint is different: clients authenticate with API keys, so admission asks
for no client certificate (`public=True`), and TLS there is optional (server certificate only).

Credentials live in one directory (`--tls-dir`, `$SLUICE_TLS_DIR`): ``ca.pem`` and, per role,
``<role>.pem`` + ``<role>-key.pem`` (mode 0600). `write_local_pki` makes such a directory with the
`cryptography` library (what `sluice up` does); an operator can supply their own (Kubernetes
Secrets mounted as files). Key material never appears on a command line or in a log.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("admission", "router", "scheduler", "worker", "planner", "operator")
"""Certificate roles; `operator` is the tooling (sluice up's health and stats checks, sluice bench)."""

HEALTH_AND_REFLECTION = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")
"""Any authenticated peer may ask these (probes and tooling)."""

CALLERS: Mapping[str, frozenset[str]] = {
    # router
    "/sluice.v1.RouterService/Route": frozenset({"admission"}),
    "/sluice.v1.RouterService/RegisterReplica": frozenset({"scheduler"}),
    "/sluice.v1.RouterService/Heartbeat": frozenset({"scheduler"}),
    "/sluice.v1.RouterService/Drain": frozenset({"planner", "operator"}),
    "/sluice.v1.RouterService/ListReplicas": frozenset({"admission", "planner", "operator", "scheduler"}),
    "/sluice.v1.RouterService/ReportUnreachable": frozenset({"admission"}),
    # scheduler
    "/sluice.v1.SchedulerService/Submit": frozenset({"admission"}),
    "/sluice.v1.SchedulerService/Cancel": frozenset({"admission"}),
    "/sluice.v1.SchedulerService/Stats": frozenset({"admission", "planner", "operator"}),
    "/sluice.v1.SchedulerService/KvSnapshot": frozenset({"router"}),
    "/sluice.v1.SchedulerService/Lookup": frozenset({"admission", "operator"}),
    "/sluice.v1.SchedulerService/RenewLease": frozenset({"admission"}),
    # prefill/decode hand-off: the decode replica's scheduler asks the prefill one; admission releases a hold it
    # abandons (its decode Submit failed)
    "/sluice.v1.SchedulerService/HeldKv": frozenset({"scheduler"}),
    "/sluice.v1.SchedulerService/ReleaseKv": frozenset({"scheduler", "admission"}),
    # worker
    "/sluice.v1.WorkerService/Execute": frozenset({"scheduler"}),
    "/sluice.v1.WorkerService/ExecuteStream": frozenset({"scheduler"}),
    "/sluice.v1.WorkerService/Info": frozenset({"scheduler", "operator"}),
    # KV transfer: the decode scheduler asks its worker to pull; that worker reads the prefill worker's blocks
    "/sluice.v1.WorkerService/PullKv": frozenset({"scheduler"}),
    "/sluice.v1.WorkerService/ReadKv": frozenset({"worker"}),
}
"""Per internal RPC, the roles that may call it; an RPC not listed here is refused to everyone."""


@dataclass(frozen=True)
class TlsFiles:
    """Where one party's credentials are: the CA that signs every peer, and its own certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def of(cls, directory: str | Path, role: str) -> TlsFiles:
        """Return the files of `role` in a credentials directory; raises FileNotFoundError naming a missing one."""
        base = Path(directory)
        files = cls(base / "ca.pem", base / f"{role}.pem", base / f"{role}-key.pem")
        for path in (files.ca, files.cert, files.key):
            if not path.is_file():
                raise FileNotFoundError(f"TLS credentials: {path} is missing (role {role!r})")
        return files

    def read(self) -> tuple[bytes, bytes, bytes]:
        """Return (CA, certificate chain, private key) as PEM bytes."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()


def server_credentials(files: TlsFiles, public: bool = False) -> Any:
    """Return grpc server credentials: mutual TLS, or server-only TLS for the public endpoint."""
    import grpc

    ca, cert, key = files.read()
    if public:
        return grpc.ssl_server_credentials([(key, cert)])
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> Any:
    """Return grpc channel credentials presenting this party's certificate and trusting only the CA."""
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def listen(server: Any, address: str, files: TlsFiles | None, public: bool = False) -> int:
    """Bind `server` to `address` (TLS when `files` are given); returns the bound port."""
    if files is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, server_credentials(files, public)))


def aio_channel(target: str, files: TlsFiles | None, options: Iterable[tuple[str, Any]] = ()) -> Any:
    """Return a grpc.aio channel to `target`: mutual TLS when `files` are given, else plaintext."""
    import grpc

    if files is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, channel_credentials(files), options=list(options))


def sync_channel(target: str, files: TlsFiles | None, *, ca: str | Path | None = None) -> Any:
    """Return a blocking grpc channel to `target` (the tooling's health and stats checks).

    `files`: mutual TLS as that party. Without files, `ca` (a PEM file) makes it server-only TLS trusting
    that CA: a client of admission's public TLS endpoint, which asks for no certificate. Neither: plaintext."""
    import grpc

    if files is None and ca is not None:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes()))
    if files is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, channel_credentials(files))


def caller_role(context: Any) -> str | None:
    """Return the role in the peer's certificate (its common name), or None for a peer without one."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else None


def may_call(method: str, role: str | None) -> bool:
    """Return True when a peer with `role` may call the full `method` name (see CALLERS)."""
    if role is None:
        return False
    if method.startswith(HEALTH_AND_REFLECTION):
        return True
    return role in CALLERS.get(method, frozenset())


# ---- a local CA for `sluice up` and the tests ------------------------------------------------------


def write_local_pki(directory: str | Path, roles: Iterable[str] = ROLES, hosts: Iterable[str] = ("127.0.0.1",
                    "localhost"), valid_days: int = 30) -> Path:
    """Write a fresh CA and one certificate per role (valid for `hosts`) into `directory`; returns it.

    Private keys are written with mode 0600; the CA's key is not kept (nothing more can be signed).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sluice local CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=valid_days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    (target / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=valid_days))
                .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (target / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = target / f"{role}-key.pem"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        os.chmod(key_path, 0o600)
    return target


def authorizer() -> Any:
    """Return the ErrorInterceptor hook that refuses a caller whose role may not call the method (CALLERS)."""
    from sluice import errors

    def authorize(method: str, context: Any) -> None:
        role = caller_role(context)
        if role is None:
            raise errors.Unauthenticated(f"{method} needs a client certificate from the deployment's CA",
                                         reason="no_client_certificate")
        if not may_call(method, role):
            raise errors.PermissionDenied(f"role {role!r} may not call {method}", reason="caller_not_allowed",
                                          metadata={"role": role[:32]})

    return authorize
