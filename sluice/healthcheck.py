"""A gRPC health probe that speaks the services' mutual TLS: `python -m sluice.healthcheck PORT --role ROLE`.

Kubernetes' built-in gRPC probe cannot present a client certificate, and a service started with
`--tls-dir` accepts only callers with one from the deployment's CA. This probe dials
`localhost:PORT` (so every certificate names `localhost` among its hosts) with the role's
certificate from `--tls-dir` / `$SLUICE_TLS_DIR` (plaintext when neither is set), asks
`grpc.health.v1.Health/Check` for `--service` ("" = the whole server), and exits 0 when the answer
is SERVING, 1 otherwise (NOT_SERVING, refused, timed out), printing one line. Health is open to any
authenticated peer (sluice.tls.HEALTH_AND_REFLECTION), so the container's own certificate will do.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.tls import ROLES, TlsFiles, sync_channel

__all__ = ["check", "main"]


def check(port: int, tls_dir: str | None, role: str, service: str = "", timeout_s: float = 3.0,
          host: str = "localhost") -> tuple[bool, str]:
    """Return (SERVING?, what was seen) for the gRPC server on `host:port`; never raises for an RPC failure.

    Raises FileNotFoundError when `tls_dir` lacks the role's files."""
    files = TlsFiles.of(tls_dir, role) if tls_dir else None
    with sync_channel(f"{host}:{port}", files) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the probe; returns the exit status (0: SERVING)."""
    parser = argparse.ArgumentParser(prog="python -m sluice.healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("port", type=int, help="the service's gRPC port on localhost")
    parser.add_argument("--role", choices=ROLES, required=True, help="whose certificate to present")
    parser.add_argument("--tls-dir", default=os.environ.get("SLUICE_TLS_DIR"),
                        help="credentials directory (default $SLUICE_TLS_DIR; none: plaintext)")
    parser.add_argument("--service", default="", help='health service name ("" = the server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        serving, seen = check(args.port, args.tls_dir, args.role, args.service, args.timeout)
    except FileNotFoundError as exc:
        serving, seen = False, str(exc)
    print(f"localhost:{args.port} {'SERVING' if serving else 'not serving'} ({seen})")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
