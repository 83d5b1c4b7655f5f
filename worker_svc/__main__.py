"""`python -m worker_svc`: run one worker (torch engine or cost model) as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from sluice.prom import WorkerMetrics, serve_metrics
from sluice.telemetry import setup_tracing
from worker_svc.backend import Backend
from worker_svc.server import WorkerRuntime, start_worker_server

log = logging.getLogger("worker_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the parsed command line (argparse exits with a usage message on bad flags)."""
    p = argparse.ArgumentParser(prog="python -m worker_svc", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50061, help="gRPC port (0 picks a free one)")
    p.add_argument("--backend", choices=("torch", "costmodel"), default="torch")
    p.add_argument("--model", default="tiny",
                   help="torch: a preset name or a model directory; costmodel: a model shape (llama-3-8b, tiny...)")
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks to offer (default: backend capacity)")
    p.add_argument("--gpu", default="h200", help="costmodel: GPU profile (h100, h200)")
    p.add_argument("--emulate-time", action="store_true",
                   help="costmodel: make each round take its modelled time (GPU-like load tests on a CPU)")
    p.add_argument("--eos-after", type=int, default=None, help="costmodel: output token N is EOS")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def backend_loader(args: argparse.Namespace) -> Callable[[], Backend]:
    """Return a function that builds the chosen backend (called in the worker thread: loading is slow)."""
    if args.backend == "costmodel":
        def load_costmodel() -> Backend:
            from worker_svc.costmodel import CostModel
            return CostModel(args.model, args.gpu, eos_after=args.eos_after)
        return load_costmodel

    def load_torch() -> Backend:
        from worker_svc.models import resolve_model
        from worker_svc.torch_backend import TorchBackend
        backend: Backend = TorchBackend(resolve_model(args.model), device=args.device, num_blocks=args.num_blocks)
        return backend
    return load_torch


async def amain(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code (1 when the backend fails to load)."""
    setup_tracing("sluice-worker")
    metrics = WorkerMetrics()
    if args.metrics_port is not None:
        serve_metrics(metrics.registry, args.metrics_port)
    runtime = WorkerRuntime(backend_loader(args), num_blocks=args.num_blocks, emulate_time=args.emulate_time,
                            metrics=metrics)
    worker = await start_worker_server(runtime, args.port, args.host)
    print(f"worker listening on {args.host}:{worker.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([worker.loading, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if worker.loading.done() and not runtime.ready.is_set():
        log.error("the backend failed to load; exiting")
        code = 1
    else:
        await stop.wait()
    await worker.stop()
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
