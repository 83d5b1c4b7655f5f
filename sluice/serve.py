"""One way to run a Sluice service process: flags, logging, tracing, metrics, signals, drain, exit code.

Every `python -m <service>` is the same life, told once here:

1. Flags become the service's frozen options (`load_options`), once. The flags are generated from the
   options dataclass (`options_parser`, sluice.options): every service's options extend ServiceOptions
   (`--host`, `--port`, `--metrics-port`, `--log-level`), those on the bus BusOptions.
2. `run_service` configures logging and tracing and calls the service's `start(ctx)` coroutine, which
   builds and starts the server and returns a `Started`. Resources that must be closed on the way out
   go on `ctx.cleanup` (an AsyncExitStack), so a start that fails half-way still closes what it opened.
   A caller-caused problem (bad config, no Redis URL, taken metrics port) is a `StartupError`: exit 2.
3. It prints `<label> listening on HOST:PORT`, waits for `Started.ready` (a worker loading its model;
   not ready means exit 1), then collects and freezes the garbage collector's heap: everything built
   during start-up (modules, the model, protobuf descriptors) moves to the permanent generation, so
   the full collections that still run on the hot path scan only what serving allocates (the scheduler
   core's benchmark saw 13-23 ms full collections without it).
4. It serves until SIGTERM or SIGINT, then awaits `Started.drain` (the graceful part), or until a
   watched task fails (a bug: exit 1, no drain), and finally closes `ctx.cleanup`.
5. A service on the bus (`open_bus`) gets a `BusWatch`: a PING every second with a short timeout
   (down at once when the PING fails, after two in a row when it is only late).
   While Redis does not answer, `Started.health` reports NOT_SERVING for `Started.health_names`
   (SERVING again when it answers), the change is logged, and `sluice_bus_up` (0/1) and
   `sluice_bus_down_total` are set in the registry given to `expose_metrics`. The service's loops
   reconnect by themselves (redis-py reconnects per command); `BusWatch.alive` lets a service refuse
   work it could not deliver (the scheduler's Submit answers UNAVAILABLE reason `bus_unavailable`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sluice.options import options_parser, parse_options
from sluice.tls import TlsFiles

if TYPE_CHECKING:
    import grpc
    from prometheus_client import CollectorRegistry

    from sluice.bus import Bus

__all__ = ["BusOptions", "BusWatch", "METRICS_LINE", "ServiceContext", "ServiceOptions", "Started", "StartupError",
           "configure_logging", "grpc_server", "load_options", "open_bus", "options_parser", "run_service"]

log = logging.getLogger("sluice.serve")
METRICS_LINE = "metrics on "
"""What starts the line a service prints with its metrics URL (sluice_tools.stack reads it back)."""
OptionsT = TypeVar("OptionsT", bound="ServiceOptions")
T = TypeVar("T")


class StartupError(Exception):
    """The service cannot start because of how it was configured; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class ServiceOptions:
    """Flags every service takes; each service's options extend this class."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    metrics_port: int | None = None
    """Prometheus port; 0 picks a free one (printed and logged); None serves no metrics."""
    metrics_host: str | None = None
    """Address the metrics endpoint listens on; None: the same as --host (loopback unless --host says otherwise)."""
    log_level: str = "INFO"
    """Logging level name for the root logger."""
    tls_dir: str | None = field(default=None, metadata={"env": "SLUICE_TLS_DIR"})
    """Directory of the deployment's TLS credentials (ca.pem, <role>.pem, <role>-key.pem): internal calls
    then use mutual TLS and each RPC admits only its callers' roles; None: plaintext (a trusted network)."""


@dataclass(frozen=True, kw_only=True)
class BusOptions(ServiceOptions):
    """Flags of a service on the Redis bus."""

    redis_url: str = field(default="", metadata={"env": "SLUICE_REDIS_URL"})
    """Redis URL; empty: none given (open_bus refuses it)."""
    namespace: str = "default"
    """Bus namespace (keys sluice:{<namespace>:<stream>}..., hash-tagged per stream)."""
    kv_shards: int = field(default=4, metadata={"env": "SLUICE_KV_SHARDS"})
    """KV event streams of the namespace (kv:0..N-1); every service of a deployment must use the same number
    (4 is sluice.bus.DEFAULT_KV_SHARDS, not imported here so that parsing flags does not load redis)."""


def load_options(cls: type[OptionsT], parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> OptionsT:
    """Return the frozen options parsed from `argv` (None: sys.argv); argparse exits 2 with usage on bad flags.

    Raises TypeError when the parser has a flag the options lack, or the reverse (a bug in the service)."""
    return parse_options(cls, parser, argv)


@dataclass
class ServiceContext:
    """What `start` gets: the options, the stop event, and a stack for what must be closed on exit."""

    options: ServiceOptions
    stop: asyncio.Event
    """Set by SIGTERM/SIGINT; long-running loops the service starts watch it."""
    cleanup: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    """Closed last, whether start-up failed or not (Redis clients, servers...)."""
    metrics_url: str = ""
    """Where the metrics are served, once `expose_metrics` has bound a port ("" before, or without metrics)."""
    bus_watch: BusWatch | None = None
    """The liveness probe of the bus, set by `open_bus` (None for a service without one)."""
    registry: CollectorRegistry | None = None
    """The service's metrics registry, as given to `expose_metrics` (the bus gauges go there too)."""

    def expose_metrics(self, registry: CollectorRegistry) -> str:
        """Serve `registry` on `--metrics-port` when one was given (0: a free port); return its URL ("" without).

        The URL is logged and printed as `metrics on URL` (METRICS_LINE), which is how a supervisor learns the
        port it did not choose. Raises StartupError when the port is taken."""
        self.registry = registry
        if self.options.metrics_port is None:
            return ""
        from sluice.prom import serve_metrics

        host = self.options.metrics_host or self.options.host
        try:
            port = serve_metrics(registry, self.options.metrics_port, host)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {host}:{self.options.metrics_port}: {exc}") from exc
        self.metrics_url = f"http://{host}:{port}/metrics"
        log.info("metrics on %s", self.metrics_url)
        print(f"{METRICS_LINE}{self.metrics_url}", flush=True)
        return self.metrics_url


@dataclass
class Started:
    """What a started service hands back to `run_service`."""

    port: int
    """The bound gRPC port (the one printed)."""
    drain: Callable[[], Awaitable[Any]] | None = None
    """Graceful stop after SIGTERM/SIGINT (health NOT_SERVING, finish in-flight work, stop the server)."""
    ready: Callable[[], Awaitable[bool]] | None = None
    """Awaited after the banner: False means the service can never serve (exit 1)."""
    watched: Sequence[asyncio.Task[Any]] = ()
    """Tasks that run for the whole life of the service: one that fails ends the process with exit 1."""
    label: str = ""
    """Who is listening, for the banner (default: the service name)."""
    detail: str = ""
    """Appended to the banner, e.g. " (owner ..., model ...)"."""
    health: Any = None
    """The service's gRPC HealthServicer (grpc_health aio): NOT_SERVING while the bus is down (BusWatch)."""
    health_names: Sequence[str] = ("",)
    """The health service names the bus state applies to ("" and the service's full name)."""


Start = Callable[[ServiceContext], Awaitable[Started]]


async def open_bus(ctx: ServiceContext, options: BusOptions, *, ping: bool = False) -> Bus:
    """Return a Bus on a new Redis client (from `options`) that `ctx.cleanup` closes; with `ping`, check Redis answers.

    Raises StartupError when no URL is given, the namespace is malformed or (with `ping`) Redis cannot be reached.
    """
    from redis.exceptions import RedisClusterException, RedisError

    from sluice.bus import Bus, redact_url, redis_client

    if not options.redis_url:
        raise StartupError("no Redis: pass --redis-url or set SLUICE_REDIS_URL")
    try:
        client = redis_client(options.redis_url)
    except (ValueError, OSError) as exc:  # a malformed URL, an unreadable password file
        raise StartupError(f"Redis at {redact_url(options.redis_url)}: {exc}") from exc
    ctx.cleanup.push_async_callback(client.aclose)
    try:
        bus = Bus(client, options.namespace, kv_shards=options.kv_shards)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    ctx.bus_watch = ctx.bus_watch or BusWatch(bus)
    if ctx.registry is not None:
        bus.count_poison_in(ctx.registry)
    if ping:
        try:
            await client.ping()
        except (RedisError, RedisClusterException, OSError) as exc:  # a cluster client connects on first use
            raise StartupError(f"cannot reach Redis at {redact_url(options.redis_url)}: {exc}") from exc
    return bus


def tls_files(options: ServiceOptions, role: str) -> TlsFiles | None:
    """Return this service's TLS credentials (None when --tls-dir is not set); raises StartupError if incomplete."""
    if not options.tls_dir:
        return None
    try:
        return TlsFiles.of(options.tls_dir, role)
    except FileNotFoundError as exc:
        raise StartupError(str(exc)) from exc


def grpc_server(*service_names: str, interceptors: Sequence[Any] = (),
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Server:
    """Return a new (not started) gRPC server that answers server reflection for `service_names`.

    Every service builds its server here, so that `grpcurl` and grpcui can list and call it without the
    protos: reflection lists `service_names`, gRPC health (every service serves it) and reflection itself,
    and describes them from the generated modules' descriptors (the default pool).
    """
    import grpc
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server(interceptors=list(interceptors), options=list(options))
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((*service_names, health_name, reflection.SERVICE_NAME), server)
    return server


EVENT_LOOP_ENV = "SLUICE_EVENT_LOOP"
"""`uvloop` (the default, when installed: the server extra pins it) or `asyncio`: the event loop every service runs
on (docs/benchmarks.md: uvloop cuts the path's CPU per streamed token by 10-20% at concurrency 16)."""


def default_event_loop() -> str:
    """Return the event loop a service runs on when $SLUICE_EVENT_LOOP is unset: uvloop if installed, else asyncio."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def use_event_loop(name: str) -> None:
    """Make `asyncio.run` use the event loop `name` (asyncio, uvloop). Raises StartupError naming $SLUICE_EVENT_LOOP
    for another name, or for uvloop when it is not installed."""
    if name == "asyncio":
        asyncio.set_event_loop_policy(None)
        return
    if name != "uvloop":
        raise StartupError(f"${EVENT_LOOP_ENV} must be asyncio or uvloop, got {name!r}")
    try:
        import uvloop
    except ImportError:
        raise StartupError(f"${EVENT_LOOP_ENV}=uvloop, but uvloop is not installed (pyproject's server extra "
                           "pins it)") from None
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_service(name: str, options: ServiceOptions, start: Start) -> int:
    """Run the service `name` until SIGTERM/SIGINT; return its exit code (0, 1 on failure, 2 on bad config)."""
    configure_logging(options.log_level)
    try:
        use_event_loop(os.environ.get(EVENT_LOOP_ENV) or default_event_loop())
    except StartupError as exc:
        log.error("%s cannot start: %s", name, exc)
        return 2
    return asyncio.run(_serve(name, options, start))


def configure_logging(level: str) -> None:
    """Log to stderr at `level`, with control characters in messages escaped (callers' values reach logs)."""
    from sluice.safe_text import EscapingFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


async def _serve(name: str, options: ServiceOptions, start: Start) -> int:
    from sluice.telemetry import setup_tracing

    ctx = ServiceContext(options, _stop_on_signals())
    async with ctx.cleanup:
        try:
            try:
                setup_tracing(f"sluice-{name}")
            except RuntimeError as exc:  # an OTLP endpoint is set but its exporter is missing
                raise StartupError(str(exc)) from exc
            finished, started = await _unless_stopped(start(ctx), ctx.stop)
        except StartupError as exc:
            log.error("%s cannot start: %s", name, exc)
            return 2
        if not finished or started is None:
            return 0  # stopped while starting
        print(f"{started.label or name} listening on {options.host}:{started.port}{started.detail}", flush=True)
        if started.ready is not None:
            finished, ready = await _unless_stopped(started.ready(), ctx.stop)
            if finished and not ready:
                log.error("%s cannot serve; exiting", name)
                return 1
        if not ctx.stop.is_set():
            log.info("%s serving; %d start-up objects frozen out of the garbage collector", name,
                     _freeze_startup_heap())
        watching = _watch_bus(ctx, started)
        failed = await _wait_for_stop(ctx.stop, started.watched)
        if watching is not None:
            watching.cancel()
        if failed is not None:
            # The service's own loop died of a bug: answering calls that never get served would hide it.
            log.error("%s task failed; exiting", name, exc_info=failed)
            return 1
        log.info("%s stopping", name)
        if started.drain is not None:
            await started.drain()
    return 0


class BusWatch:
    """Liveness of the bus: `alive` is False while Redis does not answer a PING (see step 5 above).

    A PING that fails (connection refused or reset, auth) marks the bus down at once. A PING not answered
    within `timeout_s` is ambiguous: Redis may be stalled, or this process's own event loop too busy (a CPU
    engine beside it) to read the answer in time; only `late_limit` such misses in a row mark it down, so one
    slow probe does not make the scheduler refuse work it could deliver.
    """

    def __init__(self, bus: Bus, interval_s: float = 1.0, timeout_s: float = 0.5, late_limit: int = 2) -> None:
        self.bus, self.interval_s, self.timeout_s, self.late_limit = bus, interval_s, timeout_s, late_limit
        self.alive = True
        """False from a failed PING, or `late_limit` late ones in a row, until one is answered again."""
        self.late = 0
        """Late PINGs in a row (reset by an answer)."""
        self.listeners: list[Callable[[bool], Awaitable[None]]] = []
        """Awaited with the new state on every change."""

    async def probe(self) -> bool:
        """PING once; on a change of state log it and tell the listeners; return the state."""
        from sluice.bus import PING_LATE, PING_OK

        seen = await self.bus.probe(self.timeout_s)
        self.late = self.late + 1 if seen == PING_LATE else 0
        if seen == PING_LATE and self.late < self.late_limit:
            log.warning("Redis answered no PING within %.1f s (%d in a row; down at %d)", self.timeout_s,
                        self.late, self.late_limit)
            return self.alive
        alive = seen == PING_OK
        if alive != self.alive:
            self.alive = alive
            if alive:
                log.warning("Redis answers again: serving")
            else:
                log.error("Redis does not answer: NOT_SERVING until it does")
            for listener in self.listeners:
                await listener(alive)
        return alive

    async def run(self, stop: asyncio.Event) -> None:
        """Probe every `interval_s` until `stop` is set."""
        while not stop.is_set():
            await self.probe()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


def _watch_bus(ctx: ServiceContext, started: Started) -> asyncio.Task[None] | None:
    """Start the bus liveness probe of a bus service; its health and metrics follow the bus (None: no bus)."""
    watch = ctx.bus_watch
    if watch is None:
        return None
    if started.health is not None:
        health, names = started.health, tuple(started.health_names)

        async def set_health(alive: bool) -> None:
            from grpc_health.v1 import health_pb2

            status = health_pb2.HealthCheckResponse.SERVING if alive else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in names:
                await health.set(name, status)  # a no-op once the server is shutting down gracefully

        watch.listeners.append(set_health)
    if ctx.registry is not None:
        watch.listeners.append(_bus_gauges(ctx.registry))
    return asyncio.create_task(watch.run(ctx.stop))


def _bus_gauges(registry: CollectorRegistry) -> Callable[[bool], Awaitable[None]]:
    from prometheus_client import Counter, Gauge

    up = Gauge("sluice_bus_up", "1 while Redis answers the liveness PING, 0 while it does not.", registry=registry)
    downs = Counter("sluice_bus_down", "Times Redis stopped answering the liveness PING.", registry=registry)
    up.set(1)

    async def record(alive: bool) -> None:
        up.set(1 if alive else 0)
        if not alive:
            downs.inc()

    return record


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """Return (True, result) when `work` ends first, (False, None) when a signal came first (work is abandoned)."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([working, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not working.done():
        working.cancel()
        with contextlib.suppress(asyncio.CancelledError, StartupError):
            await working
        return False, None
    return True, working.result()


async def _wait_for_stop(stop: asyncio.Event, watched: Sequence[asyncio.Task[Any]]) -> BaseException | None:
    """Wait for the stop event or the end of a watched task; return the exception of a failed one."""
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([stopping, *watched], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    for task in watched:
        if task.done() and not task.cancelled() and task.exception() is not None:
            return task.exception()
    return None


def _freeze_startup_heap() -> int:
    """Move every object alive now to the collector's permanent generation; return how many it holds."""
    # Collect first so that start-up garbage is freed rather than kept forever in the permanent generation.
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
