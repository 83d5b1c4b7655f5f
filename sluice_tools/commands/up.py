"""`sluice up`: start Redis and every service as its own process; Ctrl-C or SIGTERM stops them in order."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice_tools.stack import Stack

EXAMPLES = """\
examples:
  sluice up                                   # 1 replica of the tiny torch model on 127.0.0.1:50051
  sluice up --replicas 2 --port 0 --http-port 0   # 2 replicas, admission on free ports
  sluice up --backend costmodel --model llama-3-8b --emulate-time   # GPU-like timing, no torch
  sluice up --backend costmodel --model llama-3-8b --emulate-time --autoscale 1:3   # the planner adds/retires replicas
  sluice up --engine vllm --replicas 2        # 2 unmodified vLLM servers (make setup-vllm) under Sluice
  sluice up --disagg 1:1                      # a prefill and a decode replica: prompts' KV moves between workers
  sluice up --worker-arg=--host-blocks --worker-arg=4096 --scheduler-arg=--host-prefix-cache   # a host prefix tier
  sluice up --backend costmodel --model llama-3-8b --emulate-time --disagg 1:1 --autoscale 1:3   # pools sized apart

It prints the gRPC endpoint, the OpenAI-compatible HTTP endpoint, an API key, and a `sluice generate`
command and a curl command to try, then runs until Ctrl-C.
A process that dies is restarted (with backoff; the embedded Redis on the same port and password);
restarts are printed as they happen and counted on stop.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `sluice up`."""
    parser.epilog = EXAMPLES
    parser.add_argument("--replicas", type=int, default=1, help="worker + scheduler pairs (default: 1)")
    parser.add_argument("--admission-procs", type=int, default=1, metavar="N",
                        help="admission processes on the one gRPC and HTTP port (SO_REUSEPORT), sharing the budgets' "
                             "caps in Redis so that together they never admit more (default: 1)")
    parser.add_argument("--engine", choices=("sluice", "vllm"), default="sluice",
                        help="sluice: Sluice's own worker (--backend); vllm: an unmodified vLLM server per replica, "
                             "from the venv of `make setup-vllm`, each behind a Sluice agent (docs/engines.md) "
                             "(default: sluice)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                        help="--engine vllm: one more flag for every vLLM server (repeat it: --engine-arg=--max-num-seqs "
                             "--engine-arg=8)")
    parser.add_argument("--scheduler-arg", action="append", default=[], metavar="ARG",
                        help="one more flag for every scheduler (`python -m scheduler_svc --help`; repeat it: "
                             "--scheduler-arg=--policy --scheduler-arg=fair); a flag it refuses stops the start, "
                             "named")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="--engine sluice: one more flag for every worker (`python -m worker_svc --help`), e.g. "
                             "host KV blocks for the scheduler's host prefix tier: --worker-arg=--host-blocks "
                             "--worker-arg=4096 --scheduler-arg=--host-prefix-cache")
    parser.add_argument("--vllm-scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="--engine vllm: vLLM's own queue order; priority passes each request's priority "
                             "through (default: fcfs)")
    parser.add_argument("--vllm-scheduler-cls", default="",
                        help="--engine vllm: vLLM's --scheduler-cls, e.g. "
                             "scheduler_svc.engines.vllm.sched_cls.SluiceScheduler (Sluice's fair share inside vLLM)")
    parser.add_argument("--backend", choices=("torch", "costmodel"), default="torch",
                        help="torch: the real engine on CPU/GPU; costmodel: modelled GPU time (default: torch)")
    parser.add_argument("--model", default="tiny",
                        help="torch: a preset (tiny, generated on first use) or a Llama model directory; "
                             "costmodel: a shape such as llama-3-8b (default: tiny)")
    parser.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL"),
                        help="use this Redis instead of starting the embedded one (default: $SLUICE_REDIS_URL, "
                             "else embedded, with a random password); a password belongs in $SLUICE_REDIS_URL "
                             "or in the file named by $SLUICE_REDIS_PASSWORD_FILE, never in this flag")
    parser.add_argument("--config", default=os.environ.get("SLUICE_CONFIG"),
                        help="admission config: API keys, tenants, budgets; see docs/usage.md "
                             "(default: $SLUICE_CONFIG, else one tenant with key sk-sluice-local)")
    parser.add_argument("--port", type=int, default=50051,
                        help="admission port, the public endpoint; 0 picks a free one (default: 50051)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                             "/v1/models); 0 picks a free one; -1 serves none (default: 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address every service listens on (default: 127.0.0.1)")
    parser.add_argument("--run-dir", default=None, help="where each process logs (default: a new temp dir)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: all that fit)")
    parser.add_argument("--emulate-time", action="store_true", help="costmodel: rounds take their modelled time")
    parser.add_argument("--log-level", default="INFO", help="services' log level (default: INFO)")
    parser.add_argument("--mtls", action=argparse.BooleanOptionalAction, default=True,
                        help="internal calls over mutual TLS with a fresh local CA, each RPC admitting only its "
                             "callers' roles (default: on)")
    parser.add_argument("--redis-acl", action=argparse.BooleanOptionalAction, default=True,
                        help="embedded Redis: one ACL user per role, each service only its own streams and "
                             "commands (docs/security.md); with --redis-url, create the users with "
                             "`sluice redis-acl` (default: on)")
    parser.add_argument("--public-tls", action="store_true",
                        help="the public endpoint over TLS too; clients pass the printed CA file (--tls-ca)")
    parser.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                        help="every service serves Prometheus metrics on a free port, printed with its address "
                             "(default: on)")
    parser.add_argument("--disagg", metavar="P:D", default=None,
                        help="prefill/decode disaggregation: P prefill and D decode replicas (replaces --replicas); "
                             "each prompt runs on a prefill replica, its KV blocks move to a decode replica "
                             "(docs/disaggregation.md)")
    parser.add_argument("--autoscale", metavar="MIN:MAX", default=None,
                        help="run the planner: start with MIN replicas, add and retire replicas within MIN..MAX "
                             "from queues, prefill backlog and KV use (docs/planner.md); scale events are printed. "
                             "With --disagg P:D, each pool (prefill, decode) is sized apart within MIN..MAX")


def run(args: argparse.Namespace) -> int:
    """Start the stack, print the endpoint, wait for Ctrl-C/SIGTERM, stop gracefully; returns the exit code."""
    from sluice_tools.stack import Stack, StackConfig, StackError

    # Services run with the repository as their working directory: relative paths must be made absolute here.
    args.config = str(Path(args.config).resolve()) if args.config else None
    if (args.backend == "torch" or args.engine == "vllm") and Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    problem = _check_disagg(args) or _check_args(args) or _check_autoscale(args)
    if problem:
        print(f"sluice up: {problem}", file=sys.stderr)
        return 2
    config = StackConfig(replicas=args.replicas, disagg=args.disagg_split, backend=args.backend, model=args.model,
                         redis_url=args.redis_url,
                         config_file=args.config, admission_port=args.port, host=args.host,
                         admission_procs=args.admission_procs,
                         http_port=None if args.http_port < 0 else args.http_port,
                         run_dir=Path(args.run_dir) if args.run_dir else None, num_blocks=args.num_blocks,
                         emulate_time=args.emulate_time, log_level=args.log_level, metrics=args.metrics,
                         mtls=args.mtls or args.public_tls, public_tls=args.public_tls, redis_acl=args.redis_acl,
                         engine=args.engine, engine_args=tuple(args.engine_arg),
                         scheduler_args=tuple(args.scheduler_arg), worker_args=tuple(args.worker_arg),
                         vllm_scheduling_policy=args.vllm_scheduling_policy, vllm_scheduler_cls=args.vllm_scheduler_cls,
                         start_timeout_s=900.0 if args.engine == "vllm" else 120.0)
    stack = Stack(config)
    pair = f"(vLLM server + Sluice agent) ({args.model})" if args.engine == "vllm" else \
        f"(worker + scheduler) ({args.backend}, {args.model})"
    replicas = f"{args.replicas} x" if args.disagg_split is None else \
        f"{args.disagg_split[0]} prefill + {args.disagg_split[1]} decode x"
    print(f"starting Redis, router, {replicas} {pair} and admission; logs in {stack.run_dir}",
          file=sys.stderr, flush=True)
    # While starting, Ctrl-C or SIGTERM interrupts the start (Stack.start stops what it started).
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell's background job starts with it ignored
        signal.signal(sig, signal.default_int_handler)
    try:
        stack.start()
    except StackError as exc:
        print(f"sluice up failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted while starting; everything started is stopped.", file=sys.stderr)
        return 130
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(_banner(stack, args.config), flush=True)
    return _supervise_until_stopped(stack, stop, args.autoscale)


def _supervise_until_stopped(stack: Stack, stop: threading.Event, autoscale: str | None) -> int:
    """Restart what dies (and run the planner with --autoscale) until Ctrl-C/SIGTERM; stop; return the exit code.

    Supervision runs in this, the main, thread: processes it restarts die with it (sluice.lifeline)."""
    from sluice_tools.autoscale import (
        Autoscaler,
        PoolAutoscaler,
        local_planner_config,
        local_pools_config,
        parse_bounds,
    )
    from sluice_tools.supervisor import Supervisor

    stack.fleet.supervisor = Supervisor(stack, on_event=_print_event)
    if autoscale:
        low, high = parse_bounds(autoscale)
        warmup = stack.measured_warmup_s() or 3.0  # measured from this stack's own starts
        autoscaler: Autoscaler | PoolAutoscaler
        if stack.config.disagg is not None:
            autoscaler = PoolAutoscaler(stack, local_pools_config(low, high, load_time_s=warmup), on_event=_print_event)
            kept = f"{low} to {high} replicas in each pool (prefill, decode)"
        else:
            autoscaler = Autoscaler(stack, local_planner_config(low, high, load_time_s=warmup), on_event=_print_event)
            kept = f"{low} to {high} replicas"
        stack.fleet.supervisor.hooks.append(autoscaler.tick)
        print(f"autoscale: the planner keeps {kept} (a replica starts in {warmup:.1f} s, measured)",
              file=sys.stderr, flush=True)
        if stack.config.metrics:
            print(f"autoscale: planner metrics {autoscaler.serve_metrics()}", file=sys.stderr, flush=True)
    code = 0
    while not stop.wait(0.25):
        stack.fleet.supervise()
        if stack.fleet.supervisor.failed:
            print(f"stopping: {stack.fleet.supervisor.failed} (see {stack.run_dir})", file=sys.stderr, flush=True)
            code = 1
            break
    print("stopping: draining replicas...", file=sys.stderr, flush=True)
    stack.stop(graceful=code == 0)
    print(f"stopped. {stack.fleet.supervisor.summary()}", file=sys.stderr)
    return code


def _print_event(line: str) -> None:
    """Print a supervision or scale event with the wall-clock time (stderr)."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _check_autoscale(args: argparse.Namespace) -> str:
    """Return what is wrong with --autoscale ("" when nothing); with it, start with MIN replicas (or --replicas
    when that lies within MIN..MAX); with --disagg P:D, each side of the split brought within MIN..MAX."""
    if not args.autoscale:
        return ""
    from sluice_tools.autoscale import parse_bounds

    try:
        low, high = parse_bounds(args.autoscale)
    except ValueError as exc:
        return str(exc)
    if args.disagg_split is not None:
        args.disagg_split = tuple(min(max(side, low), high) for side in args.disagg_split)
        args.replicas = sum(args.disagg_split)
        return ""
    args.replicas = min(max(args.replicas, low), high)
    return ""


def _check_disagg(args: argparse.Namespace) -> str:
    """Return what is wrong with --disagg ("" when nothing); sets `args.disagg_split` (None without it) and, with it,
    `args.replicas` to P + D."""
    args.disagg_split = None
    if args.disagg is None:
        return ""
    from sluice_tools.sim.disagg import parse_split

    try:
        args.disagg_split = parse_split(args.disagg)
    except ValueError as exc:
        return str(exc)
    if args.engine != "sluice":
        return "--disagg needs Sluice workers (--engine sluice): KV blocks move between them"
    args.replicas = sum(args.disagg_split)
    return ""


def _check_args(args: argparse.Namespace) -> str:
    """Return what is wrong with the flags ("" when nothing): caught here, before any process starts."""
    if args.replicas < 1:
        return f"--replicas must be at least 1, got {args.replicas}"
    if args.admission_procs < 1:
        return f"--admission-procs must be at least 1, got {args.admission_procs}"
    if args.config and not Path(args.config).is_file():
        return f"--config {args.config}: no such file"
    problem = _check_config(args.config) or _check_model(args) or _check_engine(args) or _check_redis(args.redis_url)
    if problem:
        return problem
    return _check_port(args.host, args.port, "--port") or _check_port(args.host, args.http_port, "--http-port")


def _check_port(host: str, port: int, flag: str) -> str:
    """Return why `port` cannot be listened on ("" when it can, or when it is 0 or negative: none fixed)."""
    if port <= 0:
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As gRPC does: a port whose last connections linger in TIME_WAIT is still free to listen on.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return (f"cannot listen on {host}:{port} ({exc.strerror}); is another `sluice up` "
                    f"running? Pass {flag} 0 for a free port")
    return ""


def _check_config(path: str | None) -> str:
    """Return the config file's error in one line ("" when it loads): before any process starts."""
    from sluice.config import ConfigError, load_config

    try:
        load_config(path)
    except (ConfigError, OSError, ValueError) as exc:
        return f"--config {path}: {exc}"
    return ""


def _check_engine(args: argparse.Namespace) -> str:
    """Return why --engine vllm cannot start ("" when it can, or for Sluice's own engine)."""
    if args.engine != "vllm":
        return ""
    if args.worker_arg:
        return "--worker-arg is for Sluice's own workers (--engine sluice); a vLLM server takes --engine-arg"
    from sluice_tools.vllm_engine import vllm_python

    try:
        vllm_python()
    except FileNotFoundError as exc:
        return f"--engine vllm: {exc}"
    return ""


def _check_model(args: argparse.Namespace) -> str:
    """Return why --model cannot be served ("" when it is a directory, a preset, or a cost-model shape)."""
    if args.backend != "torch" and args.engine != "vllm":
        from worker_svc.gpu_profiles import model_shape

        try:
            model_shape(args.model)
        except ValueError as exc:
            return f"--model: {exc}"
        return ""
    from worker_svc.engine.presets import PRESETS

    if args.model in PRESETS or (Path(args.model) / "config.json").is_file():
        return ""
    return (f"--model {args.model}: neither a preset ({', '.join(sorted(PRESETS))}) nor a model directory "
            f"with a config.json")


def _check_redis(url: str | None) -> str:
    """Return why an external Redis cannot be used ("" when it answers PING, or when none is given)."""
    if not url:
        return ""
    import redis

    from sluice.bus import split_cluster_url

    try:
        plain_url, cluster = split_cluster_url(url)  # redis+cluster:// (sluice.bus): ping through a cluster client
        factory = redis.RedisCluster if cluster else redis.Redis
        with factory.from_url(plain_url, socket_connect_timeout=3, socket_timeout=3) as client:
            client.ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError, OSError) as exc:
        return f"--redis-url: cannot use Redis ({type(exc).__name__}: {exc})"
    return ""


def _banner(stack: Stack, config_file: str | None) -> str:
    """Return what `sluice up` prints once ready: endpoint, key, Redis, logs, traces and commands that work.

    A key from the config file is a real secret: it is shown masked and the commands read it from
    $SLUICE_API_KEY; the built-in local key (no config file) is printed as is."""
    from sluice.telemetry import describe_tracing

    configured = _first_api_key(config_file)
    key = configured or stack.api_key
    command = [*_sluice_command(), "generate", "Hello", "--target", stack.endpoint]
    command += [] if configured else ["--api-key", key]
    if stack.config.public_tls and stack.tls_ca:
        command += ["--tls-ca", stack.tls_ca]
    shown = f"{mask_key(key)} (the first key of {config_file}; export SLUICE_API_KEY=<that key> for the " \
            "commands below)" if configured else key
    security = _security_line(stack)
    traces = describe_tracing({**os.environ, **dict(stack.config.env)})
    http = f"  OpenAI:   {stack.http_base_url}\n" if stack.http_base_url else ""
    return (f"Sluice is up: each service is its own process\n{stack.describe()}\n"
            f"  endpoint: {stack.endpoint}\n{http}  API key:  {shown}\n  logs:     {stack.run_dir}\n{security}"
            f"  {traces}\n"
            f"Try: {shlex.join(command)}{_gibberish_note(stack)}\n{_curl_line(stack, '' if configured else key)}"
            "Ctrl-C to stop.")


def mask_key(key: str) -> str:
    """A secret as a banner may show it: enough to tell keys apart, not enough to use one."""
    return f"{key[:4]}…{key[-2:]}" if len(key) >= 12 else "…"


def _curl_line(stack: Stack, key: str) -> str:
    """Return a curl command against the HTTP API that works as printed ("" when none is served).

    `key` "" reads the key from $SLUICE_API_KEY in the shell (a configured key is never printed)."""
    if not stack.http_base_url:
        return ""
    body = json.dumps({"model": stack.model_id, "prompt": "Hello", "max_tokens": 16})
    command = ["curl", "-sS", f"{stack.http_base_url}/completions"]
    if stack.config.public_tls and stack.tls_ca:
        command += ["--cacert", stack.tls_ca]
    auth = shlex.quote(f"Authorization: Bearer {key}") if key else '"Authorization: Bearer $SLUICE_API_KEY"'
    rest = shlex.join(["-H", "Content-Type: application/json", "-d", body])
    return f"Or:  {shlex.join(command)} -H {auth} {rest}\n"


def _security_line(stack: Stack) -> str:
    """Return how the stack's hops are protected, one line (no secret: the CA certificate is public)."""
    if stack.tls_dir is None:
        return "  security: internal calls in plaintext (--mtls to authenticate every hop)\n"
    public = f"TLS, gRPC and HTTP (CA {stack.tls_ca})" if stack.config.public_tls else "plaintext, API keys in clear"
    return f"  security: internal calls over mutual TLS (credentials in {stack.tls_dir}); public endpoint: {public}\n"


def _gibberish_note(stack: Stack) -> str:
    """Return a warning for models whose text is noise by design ("" for the others)."""
    if stack.config.backend == "costmodel" and stack.config.engine != "vllm":
        return "\n     (the cost model returns made-up tokens: random printable characters)"
    if stack.config.model == "tiny":
        return "\n     (the tiny preset has random weights: its text is gibberish by design)"
    return ""


def _first_api_key(config_file: str | None) -> str:
    """Return the first API key of the config file ("" without a file or keys)."""
    if not config_file:
        return ""
    from sluice.config import load_config

    keys = [key for tenant in load_config(config_file).tenants for key in tenant.api_keys]
    return keys[0] if keys else ""


def _sluice_command() -> list[str]:
    """Return how to run `sluice` from a shell: `sluice` when on PATH, else this environment's script or module."""
    script = Path(sys.executable).with_name("sluice")
    on_path = shutil.which("sluice")
    if on_path and Path(on_path).resolve() == script.resolve():
        return ["sluice"]
    if script.is_file():
        relative = os.path.relpath(script)
        return [relative if not relative.startswith("..") else str(script)]
    return [sys.executable, "-m", "sluice_tools.cli"]
