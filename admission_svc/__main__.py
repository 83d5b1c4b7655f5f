"""`python -m admission_svc`: run the admission service (the front door) as a gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from admission_svc import convert
from admission_svc.core import AdmissionConfig, AdmissionCore, TenantConfig
from admission_svc.server import AdmissionMetrics, AdmissionServicer
from admission_svc.streams import token_reader_loop
from sluice.bus import Bus
from sluice.config import ConfigError, ServiceConfig, load_config
from sluice.core_errors import translate_core_error
from sluice.errors import ErrorInterceptor
from sluice.prom import serve_metrics
from sluice.telemetry import setup_tracing
from sluice.v1 import admission_pb2, admission_pb2_grpc

log = logging.getLogger("admission_svc")
SERVICE_NAME = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the parsed command line (argparse exits with a usage message on bad flags)."""
    p = argparse.ArgumentParser(prog="python -m admission_svc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--router", default="127.0.0.1:50052", help="router HOST:PORT")
    p.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--namespace", default=os.environ.get("SLUICE_NAMESPACE", "default"), help="bus namespace")
    p.add_argument("--config", default=os.environ.get("SLUICE_CONFIG"), help="TOML/JSON config (keys, budgets)")
    p.add_argument("--model", default="tiny", help="preset name or model directory (for the tokenizer)")
    p.add_argument("--model-id", default=None, help="id replicas register under (default: the directory name)")
    p.add_argument("--owner", default=None, help="token-stream owner id (default: admission-<host>-<port>)")
    p.add_argument("--resume-window-s", type=float, default=60.0, help="keep finished streams this long")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def resolve_model_dir(spec: str) -> Path:
    """Return the model directory of a preset name or path (presets are generated on first use).

    A preset that a worker has already generated is found without importing worker_svc.models,
    which imports torch (seconds and hundreds of MB that admission, a tokenizer user, does not need).
    """
    candidate = Path(spec).expanduser()
    if candidate.is_dir():
        return candidate
    home = os.environ.get("SLUICE_HOME")
    roots = [Path(home)] if home else [d / ".sluice" for d in (Path.cwd(), *Path.cwd().parents)
                                       if (d / ".git").exists() or (d / "pyproject.toml").is_file()][:1]
    for root in roots:
        generated = root / "models" / spec
        if (generated / "config.json").is_file() and (generated / "tokenizer.json").is_file():
            return generated
    from worker_svc.models import resolve_model

    return resolve_model(spec)


def admission_config(service: ServiceConfig, max_model_len: int) -> AdmissionConfig:
    """Return the core's configuration for the service config and the model length."""
    budgets = service.budgets
    tenants = tuple(TenantConfig(t.name, t.api_keys, t.weight, t.budgets.max_active_requests,
                                 t.budgets.max_pending_input_tokens, t.budgets.max_reserved_output_tokens)
                    for t in service.tenants)
    return AdmissionConfig(max_active_requests=budgets.max_active_requests,
                           max_queued_requests=budgets.max_queue_length,
                           max_pending_input_tokens=budgets.max_pending_input_tokens,
                           max_reserved_output_tokens=budgets.max_reserved_output_tokens,
                           max_model_len=max_model_len, tenants=tenants)


async def _housekeeping(servicer: AdmissionServicer, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 5.0)
        servicer.expire()


async def _consume_completions(bus: Bus, servicer: AdmissionServicer, stop: asyncio.Event) -> None:
    """Run the completion consumer, restarting it (new consumer name) if Redis fails under it."""
    group = f"admission-{servicer.owner}"
    incarnation = 0
    while not stop.is_set():
        try:
            await bus.consume("completions", group, f"{servicer.owner}-{incarnation}", servicer.on_completion,
                              stop=stop, start_id="$", claim_idle_ms=2000)
        except Exception:
            log.exception("completion consumer failed; restarting")
            incarnation += 1
            await asyncio.sleep(0.5)


def build_servicer(args: argparse.Namespace) -> AdmissionServicer:
    """Return the servicer for the flags; raises ConfigError, ValueError or OSError for bad settings."""
    model_dir = resolve_model_dir(args.model)
    model = convert.load_model_spec(model_dir, args.model_id or model_dir.name, aliases=(args.model,))
    core = AdmissionCore(admission_config(load_config(args.config), model.max_model_len))
    metrics = AdmissionMetrics()
    if args.metrics_port is not None:
        serve_metrics(metrics.registry, args.metrics_port)
    owner = args.owner or f"admission-{socket.gethostname()}-{args.port}"
    return AdmissionServicer(core, model, args.router, owner, metrics, args.resume_window_s)


async def amain(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code (2 on a configuration error)."""
    setup_tracing("sluice-admission")
    try:
        servicer = build_servicer(args)
    except (ConfigError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    owner, model = servicer.owner, servicer.model
    redis = aioredis.from_url(args.redis_url)
    bus = Bus(redis, args.namespace)
    await redis.ping()

    server = grpc.aio.server(interceptors=[ErrorInterceptor(translate_core_error)])
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(token_reader_loop(
            lambda s, last, count, block: bus.read_stream(s, last, count=count, block_ms=block),
            bus.tokens_stream(owner), servicer.registry, stop)),
        asyncio.create_task(_consume_completions(bus, servicer, stop)),
        asyncio.create_task(_housekeeping(servicer, stop)),
    ]
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"admission listening on {args.host}:{port} (owner {owner}, model {model.model_id})", flush=True)
    await stop.wait()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=5.0)
    await asyncio.gather(*tasks, return_exceptions=True)
    await servicer.close()
    await redis.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
