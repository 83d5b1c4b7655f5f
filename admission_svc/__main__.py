"""`python -m admission_svc`: run the admission service (the front door) as a gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from admission_svc.core import AdmissionConfig, AdmissionCore
from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from admission_svc.http_conn import (
    HTTP_BODY_TIMEOUT_S,
    HTTP_HEADER_TIMEOUT_S,
    HTTP_KEEPALIVE_TIMEOUT_S,
    HttpTimeouts,
)
from admission_svc.http_edge import HttpServer, serve_http
from admission_svc.server import DEFAULT_MAX_MESSAGE_BYTES, build_server
from admission_svc.shares import SHARES_STREAM, BudgetShares
from admission_svc.streams import token_reader_loop
from sluice import serve, services, tls
from sluice.bus import Bus
from sluice.config import ConfigError, ServiceConfig, load_config
from sluice.model_spec import load_model_spec
from sluice.models import find_model
from sluice.prom import AdmissionMetrics

log = logging.getLogger("admission_svc")
SERVICE_NAME = services.ADMISSION


@dataclass(frozen=True, kw_only=True)
class AdmissionOptions(serve.BusOptions):
    """The admission service's flags."""

    port: int = 50051
    """gRPC port; 0 picks a free one."""
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"env": "SLUICE_REDIS_URL"})
    """Redis URL."""
    namespace: str = field(default="default", metadata={"env": "SLUICE_NAMESPACE"})
    """Bus namespace (keys sluice:{<namespace>:<stream>}..., hash-tagged per stream)."""
    router: str = "127.0.0.1:50052"
    """Router HOST:PORT."""
    config: str | None = field(default=None, metadata={"env": "SLUICE_CONFIG"})
    """TOML/JSON config file (API keys, tenants, budgets); None: the default tenant and key."""
    model: str = "tiny"
    """Preset name or model directory (for the tokenizer)."""
    model_id: str | None = None
    """Id the replicas register under; None: the model directory's name."""
    owner: str | None = None
    """Token-stream owner id; None: admission-<hostname>-<port>."""
    resume_window_s: float = 60.0
    """Seconds finished streams are kept for a client to resume."""
    max_prompt_bytes: int = FrontDoorConfig.max_prompt_bytes
    """A text prompt over this many bytes is INVALID_ARGUMENT, untokenized."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """A request message over this many bytes is INVALID_ARGUMENT, unparsed (at least max_prompt_bytes)."""
    public_tls: bool = False
    """Serve the public endpoints (gRPC and the OpenAI HTTP port) over TLS with the admission certificate of
    --tls-dir (clients trust ca.pem; they authenticate with API keys, so no client certificate is asked for)."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API on --host (0 picks a free one); None serves none."""
    migration_limit: int = FrontDoorConfig.migration_limit
    """Moves to another replica a request may make before it ends FAILED (0: no migration)."""
    stall_timeout_s: float = FrontDoorConfig.stall_timeout_s
    """Seconds without a new token after which a request's replica is checked for loss."""
    max_finished_records: int = FrontDoorConfig.max_finished_records
    """Finished requests remembered (GetRequest, idempotent retries) at most; the oldest are forgotten first."""
    finished_record_ttl_s: float = FrontDoorConfig.finished_record_ttl_s
    """Seconds a finished request is remembered at most."""
    stream_interval: int = FrontDoorConfig.stream_interval
    """After a streamed request's first token, send its tokens once this many wait (and the rest with the finish),
    as vLLM's --stream-interval; 1 sends whatever arrived every round."""
    completion_fetch_grace_s: float = FrontDoorConfig.completion_fetch_grace_s
    """Seconds a completion fetched from its scheduler (Lookup) waits for its bus copy before it counts as lost on
    the bus (a WARNING); one whose copy comes counts as late."""
    http_header_timeout_s: float = HTTP_HEADER_TIMEOUT_S
    """An HTTP connection that has not sent a whole request head this long after it opened (or after its last
    response) is closed."""
    http_keepalive_timeout_s: float = HTTP_KEEPALIVE_TIMEOUT_S
    """An idle keep-alive HTTP connection is closed after this many seconds."""
    http_body_timeout_s: float = HTTP_BODY_TIMEOUT_S
    """An HTTP request whose whole body has not arrived this many seconds after its head is answered 408 and its
    connection closed."""
    share_budgets: bool = False
    """Share the configured caps with every admission process of the namespace (admission_svc/shares.py): run
    several behind one port (SO_REUSEPORT) or one Service and together they never admit more than the caps."""
    budget_lease_s: float = 6.0
    """--share-budgets: a process's grants are reclaimed this long after its last renewal (kill -9)."""


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of the admission service (one flag per AdmissionOptions field)."""
    return serve.options_parser(AdmissionOptions, prog="python -m admission_svc", description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> AdmissionOptions:
    """Return the admission service's options (argparse exits with a usage message on bad flags)."""
    return serve.load_options(AdmissionOptions, build_parser(), argv)


def resolve_model_dir(spec: str) -> Path:
    """Return the model directory of a path or an already generated preset.

    Admission reads only the config and tokenizer, so it never generates a preset (that needs torch);
    `sluice up` and the workers do. Raises FileNotFoundError naming the way out.
    """
    found = find_model(spec)
    if found is None:
        raise FileNotFoundError(f"model {spec!r} is neither a directory nor a generated preset; "
                                f"run `sluice model init DIR --preset {spec}` or pass --model DIR")
    return found


def admission_config(service: ServiceConfig, max_model_len: int) -> AdmissionConfig:
    """Return the core's configuration for the service config and the model length."""
    return AdmissionConfig(budgets=service.budgets, tenants=service.tenants, max_model_len=max_model_len,
                           reservation=service.reservation, ttft_slo_s=service.ttft_slo_s)


async def _housekeeping(servicer: FrontDoor, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 5.0)
        servicer.expire()


async def _consume_completions(bus: Bus, servicer: FrontDoor, stop: asyncio.Event) -> None:
    """Run the completion consumer, restarting it (new consumer name) if Redis fails under it."""
    group = f"admission-{servicer.owner}"
    incarnation = 0
    while not stop.is_set():
        try:
            # "$" at first (older completions are other processes'); after a failure "0", which matters only
            # when the group is gone with a restarted Redis: what its new stream holds came after the restart.
            await bus.consume("completions", group, f"{servicer.owner}-{incarnation}", servicer.on_completion,
                              stop=stop, start_id="$" if incarnation == 0 else "0", claim_idle_ms=2000)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.error("completion consumer lost Redis (%s); restarting", exc)  # no traceback every half second
            incarnation += 1
            await asyncio.sleep(0.5)
        except Exception:
            log.exception("completion consumer failed; restarting")
            incarnation += 1
            await asyncio.sleep(0.5)


def build_servicer(ctx: serve.ServiceContext, options: AdmissionOptions) -> FrontDoor:
    """Return the front door for the options.

    Raises serve.StartupError for a bad config, model, size limit or metrics port."""
    if not 0 < options.max_prompt_bytes <= options.max_message_bytes:
        raise serve.StartupError(f"--max-prompt-bytes ({options.max_prompt_bytes}) must be positive and at most "
                                 f"--max-message-bytes ({options.max_message_bytes})")
    for flag, value in (("--max-finished-records", options.max_finished_records),
                        ("--finished-record-ttl-s", options.finished_record_ttl_s),
                        ("--completion-fetch-grace-s", options.completion_fetch_grace_s),
                        ("--http-header-timeout-s", options.http_header_timeout_s),
                        ("--http-keepalive-timeout-s", options.http_keepalive_timeout_s),
                        ("--http-body-timeout-s", options.http_body_timeout_s)):
        if not value > 0:
            raise serve.StartupError(f"{flag} must be positive, got {value}")
    if options.stream_interval < 1:
        raise serve.StartupError(f"--stream-interval must be at least 1 (tokens), got {options.stream_interval}")
    try:
        service = load_config(options.config)  # first: a typo in the file is the cheapest thing to report
        model_dir = resolve_model_dir(options.model)
        model = load_model_spec(model_dir, options.model_id or model_dir.name, aliases=(options.model, model_dir.name))
        core = AdmissionCore(admission_config(service, model.max_model_len))
    except (ConfigError, ValueError, OSError) as exc:
        raise serve.StartupError(str(exc)) from exc
    metrics = AdmissionMetrics()
    ctx.expose_metrics(metrics.registry)
    owner = options.owner or f"admission-{socket.gethostname()}-{options.port}"
    config = FrontDoorConfig(max_prompt_bytes=options.max_prompt_bytes, resume_window_s=options.resume_window_s,
                             migration_limit=options.migration_limit, stall_timeout_s=options.stall_timeout_s,
                             max_finished_records=options.max_finished_records,
                             finished_record_ttl_s=options.finished_record_ttl_s,
                             completion_fetch_grace_s=options.completion_fetch_grace_s,
                             stream_interval=options.stream_interval)
    return FrontDoor(core, model, options.router, owner, metrics, config, serve.tls_files(options, "admission"))


async def start(ctx: serve.ServiceContext, options: AdmissionOptions) -> serve.Started:
    """Serve the front door with its stream reader, completion consumer and housekeeping; returns how to drain."""
    servicer = build_servicer(ctx, options)
    bus = await serve.open_bus(ctx, options, ping=True)
    servicer.publish_completion = bus.publish_completion
    ctx.cleanup.push_async_callback(servicer.close)  # before the Redis client closes (the stack is LIFO)
    shares = await _share_budgets(bus, servicer, options)
    # SO_REUSEPORT is grpc's default on Linux; said explicitly where several processes share the port.
    server = build_server(servicer, options.max_message_bytes,
                          (("grpc.so_reuseport", 1),) if options.share_budgets else ())
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if options.public_tls and servicer.tls_files is None:
        raise serve.StartupError("--public-tls needs --tls-dir (the admission certificate to serve)")
    port = tls.listen(server, f"{options.host}:{options.port}", servicer.tls_files if options.public_tls else None,
                      public=True)
    http = await _start_http(servicer, options)
    await server.start()
    stop = ctx.stop
    tasks = [
        asyncio.create_task(token_reader_loop(
            lambda s, last, count, block: bus.read_tokens(s, last, count=count, block_ms=block),
            bus.tokens_stream(servicer.owner), servicer.registry, stop)),
        asyncio.create_task(_consume_completions(bus, servicer, stop)),
        asyncio.create_task(_housekeeping(servicer, stop)),
        asyncio.create_task(servicer.migrator.watch(stop)),
        *([asyncio.create_task(shares.run(stop))] if shares else []),
    ]
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain() -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.gather(server.stop(grace=5.0), *([http.stop()] if http else []))
        await asyncio.gather(*tasks, return_exceptions=True)
        if shares is not None:
            with contextlib.suppress(Exception):  # not given back: the lease expires (as after kill -9)
                await shares.leave()

    http_detail = f", OpenAI HTTP API on {_scheme(options)}://{options.host}:{http.port}/v1" if http else ""
    return serve.Started(port, drain=drain, detail=f" (owner {servicer.owner}, model {servicer.model.model_id}"
                                                    f"{http_detail})",
                         health=health_servicer, health_names=("", SERVICE_NAME))


async def _share_budgets(bus: Bus, door: FrontDoor, options: AdmissionOptions) -> BudgetShares | None:
    """With --share-budgets, take this process's grants (before serving, waiting up to --budget-lease-s for the
    others to make room); raises StartupError when Redis refuses (e.g. an ACL without the budgets key)."""
    if not options.share_budgets:
        return None
    try:
        shares = BudgetShares(bus.client, bus.key(SHARES_STREAM), door.owner, door.core, options.budget_lease_s)
        # Serve once the others have made room (each shrinks at its next renewals: a few seconds at most).
        if not await shares.join(timeout_s=options.budget_lease_s):
            log.warning("budget shares not settled after %.1f s: serving with grants %s", options.budget_lease_s,
                        shares.describe())
    except Exception as exc:
        raise serve.StartupError(f"cannot share budgets in Redis: {exc}") from exc
    shares.expose(door.metrics.registry)
    log.info("sharing budgets as %s: %d live admission processes, grants %s", door.owner, shares.processes,
             shares.describe())
    return shares


def _scheme(options: AdmissionOptions) -> str:
    """The HTTP edge's URL scheme: https under --public-tls (the same certificate as the gRPC port)."""
    return "https" if options.public_tls else "http"


async def _start_http(door: FrontDoor, options: AdmissionOptions) -> HttpServer | None:
    """Start the OpenAI-compatible HTTP edge when --http-port is given; raises StartupError when the port is taken."""
    if options.http_port is None:
        return None
    try:
        http = await serve_http(door, options.host, options.http_port, options.max_message_bytes,
                                door.tls_files if options.public_tls else None,
                                HttpTimeouts(options.http_header_timeout_s, options.http_keepalive_timeout_s,
                                             options.http_body_timeout_s),
                                reuse_port=options.share_budgets)
    except OSError as exc:
        raise serve.StartupError(f"cannot serve HTTP on {options.host}:{options.http_port}: {exc}") from exc
    log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", _scheme(options), options.host, http.port)
    return http


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a configuration error)."""
    options = parse_args(argv)
    return serve.run_service("admission", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
