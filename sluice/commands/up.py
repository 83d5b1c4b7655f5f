"""`sluice up`: start Redis and every service as its own process; Ctrl-C or SIGTERM stops them in order."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `sluice up`."""
    parser.add_argument("--replicas", type=int, default=1, help="worker + scheduler pairs (default 1)")
    parser.add_argument("--backend", choices=("torch", "costmodel"), default="torch")
    parser.add_argument("--model", default="tiny", help="preset name or model directory (costmodel: a shape)")
    parser.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL"),
                        help="use this Redis instead of starting the embedded one ($SLUICE_REDIS_URL)")
    parser.add_argument("--config", default=os.environ.get("SLUICE_CONFIG"), help="admission config (TOML/JSON)")
    parser.add_argument("--port", type=int, default=50051, help="admission port, the public endpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    parser.add_argument("--run-dir", default=None, help="where each process logs (default: a temp dir)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    parser.add_argument("--emulate-time", action="store_true", help="costmodel: rounds take their modelled time")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    """Start the stack, print the endpoint, wait for Ctrl-C/SIGTERM, stop gracefully; returns the exit code."""
    from sluice.stack import Stack, StackConfig, StackError

    if args.replicas < 1:
        print("--replicas must be >= 1", file=sys.stderr)
        return 2
    config = StackConfig(replicas=args.replicas, backend=args.backend, model=args.model, redis_url=args.redis_url,
                         config_file=args.config, admission_port=args.port, host=args.host,
                         run_dir=Path(args.run_dir) if args.run_dir else None, num_blocks=args.num_blocks,
                         emulate_time=args.emulate_time, log_level=args.log_level)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(config)
    print(f"starting {args.replicas} replica(s) ({args.backend}, {args.model}); logs in {stack.run_dir}",
          file=sys.stderr, flush=True)
    try:
        stack.start()
    except StackError as exc:
        print(f"sluice up failed: {exc}", file=sys.stderr)
        return 1
    key = "from your config file" if args.config else stack.api_key
    print(f"Sluice is up.\n  endpoint: {stack.endpoint}\n  API key:  {key}\n  Redis:    {stack.redis_url}\n"
          f"  logs:     {stack.run_dir}\n"
          f"Try: sluice generate 'Hello' --target {stack.endpoint}\nCtrl-C to stop.", flush=True)
    while not stop.wait(1.0):
        dead = [p.name for p in stack.procs if not p.alive()]
        if dead:
            print(f"process(es) exited: {', '.join(dead)}; stopping (see {stack.run_dir})", file=sys.stderr)
            stack.stop(graceful=False)
            return 1
    print("stopping: draining replicas...", file=sys.stderr, flush=True)
    stack.stop()
    print("stopped.", file=sys.stderr)
    return 0
